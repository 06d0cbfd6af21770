"""One forward step: the batch, the model runner, decode inputs and their CUDA graphs, the transformers path."""
