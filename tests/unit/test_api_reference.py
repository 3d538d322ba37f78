"""The API reference against the imported modules: every public function or class that a face
of hvd_trainer holds is named on its page. Not marked ``tree`` as test_docs.py is: what a face
holds depends on its framework, so each environment checks the faces whose framework it has
(CI's first pass hvd_trainer, torch and mxnet, its TensorFlow pass tensorflow and keras)."""
import importlib
import importlib.util
import os
import re

import pytest

from test_docs import DOCS, _load_generator

API_PAGES = {"hvd_trainer": "hvd_trainer.md", "hvd_trainer.mxnet": "mxnet.md",
             "hvd_trainer.torch": "torch.md", "hvd_trainer.tensorflow": "tensorflow.md",
             "hvd_trainer.tensorflow.keras": "keras.md"}


@pytest.mark.parametrize("module", sorted(API_PAGES))
def test_the_api_reference_lists_what_the_module_exports(module):
    # Against the imported module: every public function or class it holds that is defined
    # in hvd_trainer is named on its API page, and nothing that it lacks.
    if importlib.util.find_spec("griffe") is None:
        pytest.skip("griffe (mkdocstrings' reader) is not installed here; the [test] extra "
                    "installs it")
    framework = module.split(".")[1] if "." in module else None
    if framework and importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} not installed here; see the README for its environment")
    imported = importlib.import_module(module)
    names, plain, _ = _load_generator().public_names(module)
    listed = set(names) | set(plain)
    assert all(hasattr(imported, name) for name in listed)
    with open(os.path.join(DOCS, "api", API_PAGES[module]), encoding="utf-8") as f:
        # and the names the page documents in sections of their own (hvd_trainer.run), and
        # what a module it documents whole defines (hvd_trainer.tensorflow's
        # SyncBatchNormalization, built on first use in its sync_batch_norm module)
        sections = set(re.findall(r"^::: ([\w.]+)", f.read(), re.M))
    listed |= {m.rpartition(".")[2] for m in sections}
    exported = getattr(imported, "__all__", None) or [n for n in dir(imported) if not n.startswith("_")]
    ours = {name for name in exported
            if callable(getattr(imported, name))
            and getattr(getattr(imported, name), "__module__", "").startswith("hvd_trainer")
            and getattr(imported, name).__module__ not in sections}
    assert ours <= listed, sorted(ours - listed)
