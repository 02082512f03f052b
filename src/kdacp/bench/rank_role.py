"""One rank's part of a context-parallel call, run in this process on its own: the contract benchmarks and
tests use to time or check a rank's schedule without its peers.

A :class:`RankRole` holds a plan (its ``rank`` names the rank whose tokens and layout these are), the local
backend and that rank's inputs. :meth:`RankRole.forward` and :meth:`RankRole.backward` run the rank's
schedule (:mod:`~kdacp.cp.schedule`, the code :func:`kdacp.chunk_kda` runs) against the
exchange given: the plan's own strategy by default (every rank of ``plan.group`` then runs its role), or a
:class:`StandInExchange`, which moves nothing, so one process runs any rank of any plan, ``group=None``.

    plan = CPPlan(rank=1, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=(T,) * 3, rank_layouts=rank_layouts(None, 1, (T,) * 3))
    role = RankRole.prepare(plan, q, k, v, g, beta, backend="torch")      # the middle rank of one sequence
    exchange = StandInExchange(incoming=S)                                  # S [1, HV, K, V] arrives
    out = role.forward(exchange)                                            # out.o: the rank's output
    grads = role.backward(out, do, exchange=StandInExchange())              # zero gradient arrives
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..affine import AffineMap
from ..backends.base import KDAInputs, LocalBackend
from ..backends.call import choose_call_backend, prepare_call, wants_gradient
from ..kernels.precision import resolve_precision
from ..reference.gates import compute_dtype
from ..validation import check_kda_dtypes
from ..cp.checks import check_rank_call
from ..cp.exchanges import Pending, Route, StateExchange
from ..cp.plan import CPPlan
from ..cp.schedule import CPForward, CPGrads, cp_backward, cp_forward


class StandInExchange:
    """A :class:`~kdacp.cp.exchanges.StateExchange` that moves nothing, for a rank run without
    its peers. ``send`` keeps the rank's messages (:attr:`sent`: position -> :class:`~kdacp.affine.AffineMap`
    or ``None``, of the last call); ``receive`` hands every position that receives ``incoming``
    (``[n, HV, K, V]`` in the route's dtype: the route's message shape), by default zeros, made once per shape
    and handed out on every call (a timed call then times no allocation). A position whose
    message is affine (strictly inside a chain) forms its outgoing ``M x + S`` from what it received, as
    ``p2p`` does, so the rank does the work it does in a real chain (:meth:`pass_on`, a hook for timing it).
    """

    def __init__(self, incoming: torch.Tensor | None = None):
        self.incoming, self.sent, self._zeros = incoming, {}, {}

    def begin(self, route: Route) -> Pending:
        return Pending(route)

    def send(self, pending: Pending, messages) -> None:
        pending.messages = dict(zip(pending.route.positions, messages))
        self.sent = pending.messages

    def receive(self, pending: Pending) -> list:
        route, out = pending.route, []
        for i in route.positions:
            x = None if route.source(i) is None else self._incoming(route)
            message = pending.messages.get(i)
            if x is not None and route.target(i) is not None and message is not None and not message.constant:
                self.pass_on(message, x, route)
            out.append(x)
        return out

    def pass_on(self, message: AffineMap, x: torch.Tensor, route: Route) -> torch.Tensor:
        """The value a position sends on, ``message`` applied to its incoming ``x``, rounded to the wire dtype."""
        return message.apply(x).to(route.dtype)

    def _incoming(self, route: Route) -> torch.Tensor:
        if self.incoming is not None:
            if tuple(self.incoming.shape) != tuple(route.shape):
                raise ValueError(f"incoming must have the route's message shape [n, HV, K, V] = {tuple(route.shape)}, "
                                 f"got {tuple(self.incoming.shape)}")
            return self.incoming.to(route.dtype)
        key = (route.shape, route.dtype, route.device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(route.shape, dtype=route.dtype, device=route.device)
        return self._zeros[key]


@dataclass(frozen=True)
class RankRole:
    """Rank ``plan.rank``'s part of one call: ``inputs`` its tokens packed in one row (``[1, T_local, ...]``,
    :class:`~kdacp.backends.base.KDAInputs`), ``backend`` the local backend holding the call's options,
    ``initial_state [N, HV, K, V]`` (or ``None``) and ``output_final_state`` as :func:`kdacp.chunk_kda`'s,
    ``state_dtype`` the dtype of states and summaries (``None``: float32, float64 for float64 inputs).
    :meth:`prepare` builds one from :func:`kdacp.chunk_kda`'s arguments."""

    plan: CPPlan
    backend: LocalBackend
    inputs: KDAInputs
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False
    state_dtype: torch.dtype | None = None

    @classmethod
    def prepare(cls, plan: CPPlan, q, k, v, g, beta, *, backend: str = "auto", scale=None, initial_state=None,
                output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound=None, safe_gate: bool = False,
                summary_precision=None, gate: str = "channel") -> RankRole:
        """The role of ``plan.rank`` from :func:`kdacp.chunk_kda`'s arguments, checked on this rank alone (the
        cross-rank agreement that :func:`kdacp.chunk_kda` checks needs every rank: none here). ``gate``: the
        gate's kind, ``"scalar"`` for GDN's own ``g [B, T, HV]`` and ``dt_bias [HV]``, as
        :func:`kdacp.ops.gdn.gdn_gate_arguments` returns them.

        Raises:
            ValueError, TypeError, ImportError: as :func:`kdacp.chunk_kda` for this rank's arguments (shapes
                against the plan's ``T_local`` of this rank, dtypes, backend, ``summary_precision``).
        """
        check_rank_call(plan, q, k, v, g, beta, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound, None,
                        gate)
        check_kda_dtypes(q, k, v, g, beta)
        name = choose_call_backend(backend, q.device, q, k, v, scalar_gate=gate == "scalar",
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                   use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
                                   summary_precision=summary_precision,
                                   training=wants_gradient(q, k, v, g, beta, A_log, dt_bias)).name
        resolve_precision(summary_precision, q.dtype, name="summary_precision")
        call = prepare_call(name, q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=lower_bound, safe_gate=safe_gate, summary_precision=summary_precision,
                            gate=gate)
        return cls(plan, call.backend, call.inputs, initial_state, bool(output_final_state))

    def forward(self, exchange: StateExchange | None = None) -> CPForward:
        """The rank's forward: ``o [1, T_local, HV, V]``, the final states (with ``output_final_state``) and
        what :meth:`backward` reads. ``exchange``: default the plan's strategy's (collectives on
        ``plan.group``)."""
        return cp_forward(self.backend, self.plan, self.inputs, self.initial_state, self.output_final_state,
                          self._state_dtype, exchange=exchange)

    def backward(self, forward: CPForward, do: torch.Tensor, dfinal: torch.Tensor | None = None,
                 exchange: StateExchange | None = None) -> CPGrads:
        """The rank's backward after ``forward`` (this role's): ``do [1, T_local, HV, V]``, ``dfinal
        [N, HV, K, V]`` this rank's gradient of the final states or ``None``; the input gradients and, with an
        initial state, its gradient. ``exchange`` as for :meth:`forward`."""
        return cp_backward(self.backend, self.plan, forward.saved, forward.local_initial, forward.transition,
                           forward.head_states, do, dfinal, self.output_final_state, self.initial_state is not None,
                           exchange=exchange)

    @property
    def _state_dtype(self) -> torch.dtype:
        return self.state_dtype or compute_dtype(self.inputs.q)
