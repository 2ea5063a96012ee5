"""Data parallelism of a training run: the one place that knows how many processes exist.

``msrun`` (started by ``mindmoe-launch``) gives every process ``MS_ROLE`` and the scheduler
address; :func:`init_distributed` then joins the cluster with ``mindspore.communication.init``
(HCCL on Ascend, mccl on CPU) and switches MindSpore to DATA_PARALLEL with gradient
communication fusion. Without msrun it returns the single-process layout.

Data parallelism here is plain and exact: every rank holds all parameters, computes the
gradient of its own micro-batches, and :meth:`Distributed.grad_reducer` averages gradients over
ranks once per optimizer step, so every rank applies the same update. The training step is
functional (``ms.value_and_grad``), and MindSpore only inserts the gradient all-reduce by itself
for ``nn.TrainOneStepCell``: without the reducer the ranks would silently diverge. Statistics
that steer a step (router load counts, the loss that decides whether a step is skipped, the
number of scored tokens that normalises the loss) are reduced too, so all ranks take identical
decisions.
"""

import logging
import os

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindmoe.conf.checks import Layout, resolve_layout
from mindmoe.model import kernels
from mindmoe.train.grad_norm import layout_free_norm

log = logging.getLogger("mindmoe.train")


def launched_by_msrun() -> bool:
    """msrun (and a worker started with msrun's environment) sets ``MS_ROLE`` for every process."""
    return os.environ.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED")


class Distributed:
    """This process's place in the job and the collectives training needs.

    ``rank``/``world_size`` are global; ``dp_rank``/``dp`` select this rank's share of every
    global batch. ``is_main`` (rank 0) alone writes metrics and checkpoints.
    """

    def __init__(self, rank: int, layout: Layout, ep_group: str = "", expert_dp_group: str = "", shard_groups=None):
        self.rank = rank
        self.layout = layout
        self.world_size = layout.world_size
        self.dp = layout.dp
        self.ep = layout.ep
        # Expert groups are runs of ep consecutive ranks: one data-parallel replica (allgather), or ep of them
        # (alltoall: every rank reads its own micro-batches).
        self.dp_rank = rank if layout.ep_dispatcher == "alltoall" else rank // layout.ep
        self.rank_in_group = rank % layout.ep
        self.ep_group = ep_group
        self.expert_dp_group = expert_dp_group
        # Hybrid sharding (parallel.shard_size, train/parallel/zero.py): the shard_size consecutive ranks of this one,
        # those of them holding its experts, and the ranks at its place in every other shard group ("": none).
        self.shard_group, self.expert_shard_group, self.replica_group = shard_groups or ("", "", "")
        # {expert shard's name: first row held}; the moment views of ZeRO-1 (train/parallel/zero.py) by moment name.
        self.expert_rows = {}
        self.zero_views = {}
        self.is_main = rank == 0
        if self.world_size > 1:
            all_reduce = ops.AllReduce()

            @ms.jit
            def all_reduce_sum(values):
                return all_reduce(values)

            self._all_reduce_sum = all_reduce_sum

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def expert_dispatcher(self):
        """The ``expert_dispatcher`` to build the model with: ``None`` (one process holds every expert) or,
        with ``parallel.ep > 1``, the placement that gives this rank its share of every MoE layer's experts."""
        if self.ep == 1:
            return None
        from mindmoe.train.parallel.expert_parallel import ExpertParallelDispatch

        return ExpertParallelDispatch(self.rank_in_group, self.ep, self.ep_group, self.layout.ep_dispatcher)

    def track_expert_shards(self, model) -> None:
        """Record which of ``model``'s parameters are expert shards (``parallel.ep > 1``), for the gradient
        reducer, the gradient norm and the checkpoint views; ``model`` must have been built with
        :attr:`expert_dispatcher`. Nothing in the model changes."""
        if self.ep > 1:
            from mindmoe.train.parallel.expert_parallel import expert_shards

            self.expert_rows = expert_shards(model, model.config.num_experts, self.ep)

    def track_zero(self, optimizer) -> None:
        """Record the moment views of a ZeRO-1 optimizer (train/parallel/zero.py) for :meth:`checkpoint_views`."""
        from mindmoe.train.parallel.range_views import moment_views

        self.zero_views = moment_views(optimizer, self)

    @property
    def sharded(self) -> dict:
        """``{name: first expert row or None}`` of every tensor whose checkpoint view gathers over ranks (a
        collective every rank must take part in): expert shards (``parallel.ep > 1``) and, with ZeRO-1, every
        trained parameter (its moments are split; None unless it is an expert shard)."""
        zero = {view.spec.name: None for view in self.zero_views.values()}
        return {**zero, **self.expert_rows}

    def checkpoint_views(self, params) -> list:
        """``params`` as checkpoints see them: expert tensors and AdamW moments at full size."""
        from mindmoe.train.parallel.expert_parallel import sharded_views

        params = list(params)
        plain = [p for p in params if p.name not in self.zero_views]
        viewed = iter(sharded_views(plain, self.expert_rows, self.rank_in_group, self.ep, self.ep_group))
        return [self.zero_views[p.name] if p.name in self.zero_views else next(viewed) for p in params]

    def grad_reducer(self, params):
        """``(grads, loss) -> (grads, loss)`` of the global objective (the mean over data-parallel
        replicas of their micro-batch loss; each replica's language-model term is already its share of
        the per-token mean of the global batch, ``train.step.token_weight``), for use inside a jitted step.

        Replicated parameters: every rank holds its replica's full gradient (the copy into an expert
        group sums the expert paths), so the mean over all ranks is the mean over replicas. Expert
        shards: the same experts live on one rank per replica; their gradients are averaged over
        those ``dp`` ranks only. With ``alltoall`` a rank's expert gradient is already the sum over the ``ep``
        replicas of its group whose tokens it ran, so it is summed over the ``dp / ep`` ranks holding the same
        experts and divided by all ``dp`` replicas (with one expert group: only divided).
        """
        if not self.active:

            def synchronise(grads, loss):
                return grads, loss

            return synchronise
        params = list(params)
        expert_idx = [i for i, p in enumerate(params) if p.name in self.expert_rows]
        dense_idx = [i for i, p in enumerate(params) if p.name not in self.expert_rows]
        dense_reducer = nn.DistributedGradReducer([params[i] for i in dense_idx], mean=True, degree=self.world_size)
        expert_reducer = None
        # Without other groups, dp is 1 (allgather) or ep (alltoall: the gradient summed the group's replicas).
        expert_scale = 1.0 / self.dp
        if expert_idx and self.expert_dp_group:
            expert_reducer = nn.DistributedGradReducer(
                [params[i] for i in expert_idx], mean=True, degree=self.dp, group=self.expert_dp_group
            )
        loss_all_reduce = ops.AllReduce()
        inv_world = 1.0 / self.world_size
        if not expert_idx:

            def synchronise(grads, loss):
                return dense_reducer(grads), loss_all_reduce(loss) * inv_world

            return synchronise
        order = [0] * len(params)
        for position, index in enumerate(dense_idx + expert_idx):
            order[index] = position

        def synchronise(grads, loss):
            dense = dense_reducer(tuple(grads[i] for i in dense_idx))
            experts = tuple(grads[i] for i in expert_idx)
            if expert_reducer is not None:
                experts = expert_reducer(experts)
            elif expert_scale != 1.0:
                experts = tuple(g * expert_scale for g in experts)
            merged = dense + experts
            return tuple(merged[i] for i in order), loss_all_reduce(loss) * inv_world

        return synchronise

    def squared_grad_norm(self, params, expert_names=frozenset()):
        """``grads -> |g|^2`` of the whole model's (synchronised) gradient, the same on every rank and bit for bit
        the one process's (:func:`train.grad_norm.layout_free_norm`): ``expert_names``, the routed expert tensors
        (:func:`train.grad_norm.expert_parameter_names`), contribute per expert row; with ``parallel.ep > 1`` each
        rank holds its experts' rows only, gathered over the expert group."""
        params = list(params)
        if self.ep == 1:
            return layout_free_norm(params, expert_names)
        unsharded = sorted(p.name for p in params if p.name in expert_names and p.name not in self.expert_rows)
        if unsharded:
            raise RuntimeError(f"parallel.ep={self.ep}: expert tensors {unsharded[:3]} are not sharded")
        gather = kernels.all_gather(self.ep_group, self.ep, self.rank_in_group)
        return layout_free_norm(params, set(self.expert_rows), gather, self.ep)

    @property
    def replica_copies(self) -> int:
        """Ranks holding the same micro-batches: an expert group of ``allgather`` (sums over ranks count each
        ``ep`` times); 1 with ``alltoall``, whose ranks all read their own."""
        return self.ep // self.layout.replicas_per_group

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any; also a barrier (all ranks must call it)."""
        if not self.active:
            return bool(flag)
        return bool(self.sum_over_ranks(np.array([float(flag)]))[0] > 0)

    def sum_count_over_replicas(self, count: int) -> int:
        """The sum of a non-negative integer over data-parallel replicas, exactly (all ranks must call it).

        The collective sums float32, exact only below 2**24: the count travels as two base-4096
        digits, whose sums stay exact for totals below 2**36 on fewer than 4096 ranks. Ranks holding the
        same micro-batches are counted once (:attr:`replica_copies`).
        """
        if not self.active:
            return int(count)
        high, low = self.sum_over_ranks(np.array([count >> 12, count & 4095]))
        return (int(high) * 4096 + int(low)) // self.replica_copies

    def sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum of a host array over all ranks (float32; identity in one process)."""
        values = np.asarray(values, dtype=np.float32)
        if not self.active:
            return values
        return self._all_reduce_sum(Tensor(values)).asnumpy()


def init_distributed(
    parallel, num_experts: int, global_batch_size: int, micro_batch_size: int, has_moe_layers: bool
) -> Distributed:
    """Join the msrun cluster if this process was started by it, else the one-process layout.

    In msrun's scheduler process ``init()`` serves the cluster and exits when the workers are done,
    so nothing after it runs there.
    """

    def layout_of(world_size: int):
        return resolve_layout(
            world_size,
            parallel.dp,
            parallel.ep,
            num_experts,
            global_batch_size,
            micro_batch_size,
            has_moe_layers,
            parallel.ep_dispatcher,
            parallel.shard_size,
            parallel.zero,
        )

    if not launched_by_msrun():
        return Distributed(0, layout_of(1))
    from mindspore.communication import get_group_size, get_rank, init

    init()
    world_size, rank = get_group_size(), get_rank()
    layout = layout_of(world_size)
    ep_group, expert_dp_group = _expert_groups(rank, layout)
    shard_groups = _shard_groups(rank, layout)
    ms.reset_auto_parallel_context()
    # Fused all-reduce buckets instead of one all-reduce per parameter (on these CPU machines this
    # roughly halves the step time of two ranks).
    ms.set_auto_parallel_context(
        parallel_mode=ms.ParallelMode.DATA_PARALLEL,
        gradients_mean=True,
        device_num=world_size,
        comm_fusion={"allreduce": {"mode": "auto", "config": None}},
    )
    log.info(
        "rank %d of %d (pid %d): data parallel %d, accumulation %d",
        rank,
        world_size,
        os.getpid(),
        layout.dp,
        layout.accumulation,
    )
    return Distributed(rank, layout, ep_group, expert_dp_group, shard_groups)


def _expert_groups(rank: int, layout: Layout):
    """Communication groups of expert parallelism: this rank's expert group (``ep`` consecutive
    ranks) and the ranks holding the same experts in the other groups (``world_size / ep`` of them)."""
    if layout.ep == 1:
        return "", ""
    from mindspore.communication import GlobalComm, create_group

    if layout.ep == layout.world_size:
        ep_group = GlobalComm.WORLD_COMM_GROUP
    else:
        first = rank // layout.ep * layout.ep
        ep_group = f"expert_group_{first // layout.ep}"
        create_group(ep_group, list(range(first, first + layout.ep)))
    expert_dp_group = ""
    if layout.world_size > layout.ep:
        position = rank % layout.ep
        expert_dp_group = f"expert_dp_group_{position}"
        create_group(expert_dp_group, list(range(position, layout.world_size, layout.ep)))
    return ep_group, expert_dp_group


def _shard_groups(rank: int, layout: Layout):
    """Communication groups of hybrid sharding (``parallel.shard_size`` below the world): ``(shard group, expert
    shard group, replica group)``; "" for each one that has no other rank or is not needed."""
    if layout.shard_replicas == 1:
        return "", "", ""
    from mindspore.communication import create_group

    size = layout.shard_size
    first = rank // size * size
    shard_group = f"shard_group_{first // size}"
    create_group(shard_group, list(range(first, first + size)))
    expert_shard_group = ""
    if layout.ep > 1 and size > layout.ep:
        position = rank % layout.ep
        expert_shard_group = f"expert_shard_group_{first // size}_{position}"
        create_group(expert_shard_group, list(range(first + position, first + size, layout.ep)))
    replica_group = f"replica_group_{rank % size}"
    create_group(replica_group, list(range(rank % size, layout.world_size, size)))
    return shard_group, expert_shard_group, replica_group
