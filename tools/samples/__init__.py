"""Scripts that build the bundled samples in ``data/samples/``: the pretraining corpus, the SFT set, the tiny base."""
