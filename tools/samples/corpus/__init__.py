"""The document families of the sample corpus, one module each; ``tools.samples.generate_corpus`` mixes them."""
