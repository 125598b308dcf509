"""Framework integrations: the engine applied from a training framework's own callback system.

* ``chameleon_swap.integrations.transformers.ChameleonCallback``: Hugging Face ``Trainer``
  (extra ``[hf]``); its module also documents the pattern for Accelerate-prepared loops.
* ``chameleon_swap.integrations.lightning.ChameleonCallback``: ``lightning.pytorch`` (extra
  ``[lightning]``).

Each submodule imports its framework when it is imported itself, never before: ``import
chameleon_swap`` (and this package) stay free of transformers and lightning.

May import: the public ``chameleon_swap`` package only (what a user's own code would import).
Imported by: users' training scripts; nothing in the package.
"""
