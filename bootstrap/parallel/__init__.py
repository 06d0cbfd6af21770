"""Several ranks on one machine: the torch.distributed ``Collective`` (``torch_dist``) that the
stage runner's port (``bootstrap.pipeline.collective``) talks through, and the launcher that
starts the ranks of ``bootstrap run --tp N`` (``launch``)."""
