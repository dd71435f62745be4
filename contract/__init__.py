"""What the trainer and the server must agree on, defined once: token ids, the tokenizer folder, the bundle's
manifest and files, the graph's input and output names, and how onnxruntime opens a bundle.

Torch-free (numpy, sentencepiece, onnx, onnxruntime): `trainer/` writes what these modules describe and `serving/`
reads it, and neither retypes a constant. Modules, lowest first:
  errors.py    TokenizerError, BundleError
  tokens.py    special ids, the vocabulary rule, the tokenizer folder and the encoder
  graph.py     input/output names and axes of model.onnx
  runtime.py   onnxruntime graph-optimisation levels, providers, session options
  manifest.py  the typed manifest.json
  bundle.py    the one bundle verifier
  comments.py  a config dataclass's field comments as its documentation (trainer config, the server's --help)
  version.py   the `--version` line of every command line, from the installed package's metadata
"""
