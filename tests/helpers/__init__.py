"""Helpers every test directory shares, imported the same way everywhere (``from helpers.X import``;
``tests/conftest.py`` puts ``tests/`` on the path):

- ``tiny_models``: tiny seeded models of several architectures and checkpoint directories of them
  (a word-level tokenizer, an optional chat template); nothing is downloaded;
- ``broken_checkpoints``: such a checkpoint broken in one way (a header edited, tensors replaced or split);
- ``tiny_tokenizers``: tiny BPE, WordPiece and word-level tokenizers with the config options a test sets;
- ``tiny_llama``: a tiny Llama and a ``PyExecutor`` on it, its transformers reference, CPU-time helpers;
- ``smollm2``: the default model, SmolLM2-135M-Instruct, fetched once (the ``smollm2_cache`` fixture);
- ``tp_ranks``: what each spawned rank of a tensor-parallel test runs;
- ``serve_process``, ``serve_backends``: a ``bootstrap serve`` child process, and test backends it loads;
- ``trtllm_setup``, ``fake_trtllm``: the trtllm backend on a fake TensorRT-LLM generated from the manifest.
"""
