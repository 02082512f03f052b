"""The context-parallel hooks are declared once (:class:`kdacp.cp.hooks.CPHooks`): the token mixer calls
nothing else on its mode, and every mode defines each hook itself."""
import ast
import inspect

import pytest

from kdacp.cp import context
from kdacp.layers import delta_rule
from kdacp.cp.hooks import CPHooks

HOOKS = {n for n in vars(CPHooks) if not n.startswith("_")} | set(CPHooks.__annotations__)


def test_the_mixer_calls_only_declared_hooks():
    """Every ``cp.<name>`` read in :mod:`kdacp.layers.delta_rule` (the mixer and the layer's ``cp`` setter)."""
    tree = ast.parse(inspect.getsource(delta_rule))
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and isinstance(node.value, ast.Name) and node.value.id == "cp"} - {"setter"}
    assert called == HOOKS


def _modes():
    modes = [context._SingleDevice, context.ContextParallel]
    try:
        from kdacp.integrations.transformers.prefill import LayerPrefill
    except ImportError:  # transformers absent
        return modes
    return modes + [LayerPrefill]


@pytest.mark.parametrize("mode", _modes(), ids=lambda m: m.__name__)
def test_each_mode_defines_every_hook(mode):
    assert CPHooks in mode.__mro__
    assert not hasattr(mode, "__getattr__"), "a mode names its hooks instead of forwarding attributes"
    own = mode.__mro__[:mode.__mro__.index(CPHooks)]  # the mode and its bases before the protocol
    for name in HOOKS:
        assert any(name in vars(c) for c in own), f"{mode.__name__} lacks {name} (the protocol's stub stands)"
