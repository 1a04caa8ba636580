"""The one place that replaces a module's ``forward``: an attribute of the instance, set and taken away.

``nn.Module.__call__`` runs ``self.forward``, and Python finds an attribute in
the instance's ``__dict__`` before the class's. A ``forward`` set there changes
what a module runs while its class, its place in its parent, its hooks and its
``state_dict`` keys stay as they were (torch's ``checkpoint_wrapper`` renames
every key: pytorch#117399, pytorch#108269); deleting it gives the class's
forward back. ``None`` below always means "no forward of its own: the class's".

Who replaces what:

- installing, until taken off: :func:`set_forward`. ``wrap.py`` puts a
  ``CheckpointedForward`` on each wrapped module, ``op_groups.py`` a
  ``TracedForward`` on a regrouped one; each remembers the forward it replaced
  (its ``previous``) and taking it off is ``set_forward(module, previous)``.
- measuring, for a moment: :class:`TemporaryForwards`. Profiling records each
  layer's calls (``planning/steps.py``), timing runs every layer ``full``
  (``planning/timing.py``), ``wrap.checkpointing_disabled`` runs a model
  unwrapped; each gets back exactly what each module had, the very object or
  none, when the block ends, by an exception too.

No other module of ``ckpt_plugin`` writes ``forward``: ``tests/test_forwards.py``
reads every module's source and fails otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

Forward = Callable[..., Any]


def instance_forward(module: nn.Module) -> Forward | None:
    """The forward set on ``module`` itself; None where its class's runs."""
    return module.__dict__.get("forward")


def set_forward(module: nn.Module, forward: Forward | None) -> None:
    """``module`` runs ``forward`` from now on; None: its class's forward again."""
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = forward


class TemporaryForwards:
    """Forwards replaced for as long as a ``with`` block lasts.

        with TemporaryForwards([(layer, counted(layer.forward))]) as forwards:
            forwards.replace(other, recorded(other.forward))  # more, inside the block
            ...
        # each module has again exactly what it had: the same object, or no forward of its own

    Each module gets back the forward it had before this object first replaced
    it, when the block ends, by an exception too (one raised while the given
    pairs are replaced included). A module replaced twice layers the two (the
    second may wrap the first, read through ``module.forward``) and still gets
    the first one's predecessor back. Blocks nest: an inner one restores what
    the outer one set. A forward installed by ``wrap.py`` is replaced like any
    other and comes back as the same wrapper, so a new forward may wrap it
    (``module.forward`` is then the checkpointed call).
    """

    def __init__(self, forwards: Iterable[tuple[nn.Module, Forward | None]] = ()) -> None:
        self._given = list(forwards)
        self._before: dict[int, tuple[nn.Module, Forward | None]] = {}  # id(module) -> (it, its forward before)

    def replace(self, module: nn.Module, forward: Forward | None) -> None:
        """``module`` runs ``forward`` (None: its class's) until the block ends."""
        self._before.setdefault(id(module), (module, instance_forward(module)))
        set_forward(module, forward)

    def restore(self) -> None:
        """Every module replaced gets its forward from before back (the block's end calls it)."""
        before, self._before = self._before, {}
        for module, forward in before.values():
            set_forward(module, forward)

    def __enter__(self) -> TemporaryForwards:
        try:
            for module, forward in self._given:
                self.replace(module, forward)
        except BaseException:
            self.restore()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


__all__ = ["Forward", "TemporaryForwards", "instance_forward", "set_forward"]
