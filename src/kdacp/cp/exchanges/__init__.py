"""State exchanges (strategies), one module each, registered in :data:`EXCHANGES` by
:func:`register_exchange`: ``p2p`` (wavefront), ``allgather`` (one collective, local fold) and ``scan``
(segmented prefix scan in ``ceil(log2 L)`` rounds). The interface and what they share is in :mod:`.base`;
each module also supplies its exchange's cost-model program. Adding one: a module with a class decorated by
``@register_exchange(name)`` (docs/ARCHITECTURE.md, "How to add an exchange")."""
from .base import (AUTO_PRIORITY, EXCHANGES, ModelOutbox, ModelRoute, OrderedSends, Pending, Route, StateExchange,
                   auto_candidates, chain_depths, handling_order, make_exchange, register_exchange)
# kdacp's own exchanges, registered on import in this order
from .p2p import P2PExchange
from .allgather import AllGatherExchange
from .scan import ScanExchange, ScanSchedule, scan_schedule

__all__ = ["AUTO_PRIORITY", "AllGatherExchange", "EXCHANGES", "ModelOutbox", "ModelRoute", "OrderedSends",
           "P2PExchange", "Pending", "Route", "ScanExchange", "ScanSchedule", "StateExchange", "auto_candidates",
           "chain_depths", "handling_order", "make_exchange", "register_exchange", "scan_schedule"]
