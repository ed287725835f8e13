"""Import strings (`module:function`): a builder's parameters read from its module's source, without
running the module; a name the source does not settle is left to an import."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from support import printed_by_a_fresh_process

from towerflow.errors import SpecError
from towerflow.imports import import_ref, signature_from_source
from towerflow.runtime.user_errors import check_model
from towerflow.spec.schema import ModelSpec

# A model module's top imports Keras: reading its source must not run it.
_RAISES_IF_RUN = 'raise RuntimeError("the module was run")\n'


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write `user_model.py` with the given source onto sys.path; it is not imported."""

    def write(source: str) -> str:
        (tmp_path / "user_model.py").write_text(_RAISES_IF_RUN + textwrap.dedent(source))
        return "user_model"

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_model", raising=False)
    yield write
    assert "user_model" not in sys.modules


def test_a_builders_parameters_are_read_from_its_source(user_module):
    user_module(
        """
        import keras

        def helper(): ...

        def build(units, /, layers: int = 2, *extra, dropout: float = 0.1, seed, **options) -> "keras.Model":
            build = None  # a local name, not the module's
            return keras.Sequential()
        """
    )
    signature = signature_from_source("user_model:build")
    assert str(signature) == "(units, /, layers=None, *extra, dropout=None, seed, **options)"


@pytest.mark.parametrize(
    "source",
    [
        "import functools\n@functools.cache\ndef build(units): ...\n",  # a decorator may change it
        "def build(units): ...\nbuild = make_another()\n",  # bound twice
        "class build:\n    def __init__(self, units): ...\n",
        "from elsewhere import build\n",
        "from elsewhere import *\ndef build(units): ...\n",  # the star may bind it too
        "try:\n    from fast import build\nexcept ImportError:\n    def build(units): ...\n",
        "if True:\n    def build(units): ...\n",
        "def biuld(units): ...\n",  # not bound at all: the import names what is missing
    ],
    ids=["decorated", "rebound", "class", "imported", "star", "try", "if", "missing"],
)
def test_a_name_the_source_does_not_settle_is_left_to_an_import(user_module, source):
    user_module(source)
    assert signature_from_source("user_model:build") is None


def test_a_module_without_source_is_left_to_an_import():
    assert signature_from_source("no_such_package.model:build") is None
    assert signature_from_source("math:sqrt") is None  # a C extension


def test_a_misspelt_model_parameter_is_named_without_running_the_model_module(user_module):
    user_module("def build(units, layers=2): ...\n")
    check_model(ModelSpec(ref="user_model:build", params={"units": 8, "layers": 2}))  # fits
    with pytest.raises(
        SpecError, match=r"^model\.params: .*'layerz' \(user_model:build takes: units, layers\)"
    ):
        check_model(ModelSpec(ref="user_model:build", params={"units": 8, "layerz": 2}))


def test_user_code_the_driver_imports_finds_tensorflow_imported_lean(tmp_path):
    # A user's module that imports Keras at its top, imported in a fresh process as the driver does
    # (a hook, a model it must build): TensorFlow comes first, without Keras's scikit-learn and
    # matplotlib, with the GPUs hidden.
    (tmp_path / "user_hook.py").write_text("import keras\n\ndef make():\n    return keras.__name__\n")
    code = (
        "import sys; from towerflow.imports import import_user_code\n"
        "print(import_user_code('user_hook:make', key='supervision.hooks[0]')())\n"
        "print(sorted({m.partition('.')[0] for m in sys.modules} & {'sklearn', 'matplotlib'}))\n"
        "import tensorflow as tf; print(tf.config.get_visible_devices('GPU'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    assert printed_by_a_fresh_process(code, env) == ["keras", "[]", "[]"]


def test_a_module_that_does_not_compile_is_named_with_its_file_and_line(user_module):
    user_module("def build(units:\n    return units\n")
    with pytest.raises(
        SpecError, match=r"^model\.ref: importing 'user_model' failed: .*user_model\.py, line 2: "
    ):
        import_ref("user_model:build")


def test_a_module_that_raises_as_it_is_imported_is_named_with_what_and_where(user_module):
    user_module("def build(units): ...\n")
    with pytest.raises(
        SpecError,
        match=r"^supervision\.hooks\[0\]: importing 'user_model' failed: RuntimeError: the module was run "
        r"\(.*user_model\.py, line 1\)$",
    ):
        import_ref("user_model:build", key="supervision.hooks[0]")


def test_user_code_not_found_here_fails_without_importing_tensorflow():
    # The driver leaves a model module it cannot import to the workers (Ray may ship it to them):
    # finding that out costs no TensorFlow import.
    code = (
        "import sys\nfrom towerflow.imports import UnimportableModule, import_user_code\n"
        "try:\n    import_user_code('shipped_elsewhere.model:build')\n"
        "except UnimportableModule as exc:\n    print(type(exc).__name__, 'tensorflow' in sys.modules)\n"
    )
    assert printed_by_a_fresh_process(code) == ["UnimportableModule False"]
