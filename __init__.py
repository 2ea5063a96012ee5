"""mindmoe: pretrain and fine-tune GLM-4.5 / GLM-5-family Mixture-of-Experts transformers with MindSpore."""

__version__ = "0.1.0"
