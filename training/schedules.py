"""Pipeline schedules: DeepSpeed's 1F1B, a zero-bubble 1F1B (ZB-H1) and DeepSpeed's DualPipeV, and the
timeline of the instruction lists each engine executes.

- `1f1b`: DeepSpeed's `TrainSchedule`. Stage s runs p - s - 1 warm-up forwards, then one forward and one backward
  in turn; each backward computes input and weight gradients together. Its bubble is (p - 1) / (m + p - 1).
- `zero_bubble` (`ZeroBubbleSchedule`, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", schedule ZB-H1): the
  same communication as 1F1B, instruction for instruction, but every `BackwardPass` computes only the gradient
  of its input (B), which is what the upstream stage waits for, and the weight gradients it defers are computed
  by a `WeightPass` (W) placed where the stage would otherwise wait: the cool-down, where 1F1B idles, and
  the end of the step. Gradient clipping and the optimizer step follow the last W. The activation memory is
  1F1B's; the deferred W of at most p - s micro-batches hold their linear layers' inputs and output gradients.
- `dualpipev` (DeepSeek-V3; DeepSpeed's `DualPipeVSchedule`): each rank holds two stages in a V, so rank 0 loads
  the data and computes the loss; needs at least 2p micro-batches.

`timeline()` replays the instruction lists (the same objects the engines execute) with blocking point-to-point
semantics and given costs of F, B and W, for `python -m tools.schedule` and the memory planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepspeed.runtime.pipe import schedule as ds


class WeightPass(ds.BufferOpInstruction):
    """Compute the weight gradients the `BackwardPass` of this buffer deferred (zero-bubble schedules)."""


class ZeroBubbleSchedule(ds.TrainSchedule):
    """1F1B with each backward split into B (input gradients, on the critical path) and W (weight gradients).

    The communication instructions are 1F1B's, in the same order, so the pairing of sends and receives between
    neighbouring stages (and its freedom from deadlock) is DeepSpeed's. A backward's W runs at the end of a later
    step: the first one where the stage would otherwise idle (1F1B's cool-down), or, once more than
    `MAX_PENDING` are waiting, the next one, behind that step's forward, so the gradient a neighbour waits for
    leaves a W earlier than with 1F1B. Those still waiting run at the end, before the gradients are reduced.

    NOTE: placements compared with `timeline()` (costs F=1, B=2, W=1): W right behind the next step's send
    delays the neighbour's next forward and is slower than 1F1B; at the end of the next step with at most one
    W waiting, p=2 x m=4 takes 0.93 of 1F1B's time (the best possible for B = 2F there), p=4 x m=4 0.81,
    p=8 x m=8 0.82; two waiting gained little more for another micro-batch of deferred memory.
    """

    MAX_PENDING = 1

    def steps(self):
        pending: list[int] = []
        for cmds in super().steps():
            cmds = list(cmds)
            final = [c for c in cmds if isinstance(c, (ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep))]
            body = [c for c in cmds if c not in final]
            computes = any(isinstance(c, (ds.ForwardPass, ds.BackwardPass)) for c in body)
            if pending and (len(pending) > self.MAX_PENDING or not computes):
                body.append(WeightPass(pending.pop(0)))
            pending += [c.buffer_id for c in body if isinstance(c, ds.BackwardPass)]
            if final:
                body += [WeightPass(b) for b in pending]
                pending = []
            yield body + final


def train_schedule(name: str, micro_batches: int, stages: int, stage_id: int) -> ds.PipeSchedule:
    if name == "zero_bubble":
        return ZeroBubbleSchedule(micro_batches, stages, stage_id)
    if name == "dualpipev":
        return ds.DualPipeVSchedule(micro_batches, stages, stage_id)
    return ds.TrainSchedule(micro_batches, stages, stage_id)


def instructions(name: str, micro_batches: int, stages: int) -> list[list[ds.PipeInstruction]]:
    """Each pipeline rank's instructions, flattened, as its engine executes them."""
    return [[c for step in train_schedule(name, micro_batches, stages, s).steps() for c in step] for s in range(stages)]


def memory_states(name: str, micro_batches: int, stages: int, stage: int) -> list[tuple[int, int, int]]:
    """What pipeline rank `stage` holds after each compute instruction of its list: (micro-batches whose forward
    through its first stage has run and whose backward has not, the same for its second stage (DualPipeV),
    backward passes whose deferred weight gradients wait for their W). The memory planner weighs them."""
    held, waiting, out = [0, 0], 0, []
    for cmd in (c for step in train_schedule(name, micro_batches, stages, stage).steps() for c in step):
        phase = cmd.kwargs.get("phase", 0) if isinstance(cmd, ds.BufferOpInstruction) else 0
        if isinstance(cmd, ds.ForwardPass):
            held[phase] += 1
        elif isinstance(cmd, ds.BackwardPass):
            held[phase] -= 1
            waiting += name == "zero_bubble"
        elif isinstance(cmd, WeightPass):
            waiting -= 1
        else:
            continue
        out.append((held[0], held[1], waiting))
    return out


@dataclass
class Costs:
    """Time of one rank's forward, whole backward and weight-gradient part of a backward (W <= B) of a micro-batch
    through the layers of a 1F1B stage (DualPipeV's two chunks of half as many layers each take half)."""

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0


@dataclass
class Span:
    stage: int
    start: float
    end: float
    kind: str  # "F", "B", "W" (compute); waits are the gaps
    micro_batch: int
    phase: int = 0


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)  # per rank

    @property
    def step_time(self) -> float:
        return max(self.finish)

    def busy(self, stage: int) -> float:
        return sum(s.end - s.start for s in self.spans if s.stage == stage)

    @property
    def bubble(self) -> float:
        """Idle share of all ranks over the step."""
        total = self.step_time * len(self.finish)
        return 1 - sum(self.busy(s) for s in range(len(self.finish))) / total


def timeline(name: str, micro_batches: int, stages: int, costs: Costs = Costs()) -> Timeline:
    """Replay each rank's instruction list: compute takes its cost; a send and its matching receive (the n-th of
    their kind between the two ranks) complete together, once both sides have reached them (blocking, as gloo and
    NCCL point-to-point are for these tensors); DualPipeV's queued operations complete at the `CommitP2P` of both
    sides. Raises RuntimeError if the lists deadlock.
    """
    programs = instructions(name, micro_batches, stages)
    dual, split = name == "dualpipev", name == "zero_bubble"
    chunk = 0.5 if dual else 1.0  # a DualPipeV rank holds two stages of half the layers each
    cost = {
        ds.ForwardPass: chunk * costs.forward,
        WeightPass: costs.weight,
        ds.BackwardPass: chunk * (costs.backward - costs.weight if split else costs.backward),
    }
    keys = [_p2p_keys(stage, program) for stage, program in enumerate(programs)]
    clock, pc = [0.0] * stages, [0] * stages
    arrived: dict[tuple, tuple[int, float]] = {}  # p2p key -> (rank, time) of the first side to reach it
    done: dict[tuple, float] = {}
    committed: dict[tuple, float] = {}  # (p2p key, rank) -> time that rank committed it
    batch: list[list[tuple]] = [[] for _ in range(stages)]
    micro_batch: list[dict] = [{} for _ in range(stages)]  # (phase, buffer) -> micro-batch, for drawing
    forwards = [[0, 0] for _ in range(stages)]
    out = Timeline()
    while any(pc[s] < len(programs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pc[s] < len(programs[s]):
                cmd, key = programs[s][pc[s]], keys[s][pc[s]]
                if key is not None and dual:
                    batch[s].append(key)
                elif key is not None:
                    if key in done:
                        clock[s] = max(clock[s], done.pop(key))
                    elif key in arrived and arrived[key][0] != s:
                        clock[s] = done[key] = max(clock[s], arrived.pop(key)[1])
                    else:
                        arrived.setdefault(key, (s, clock[s]))
                        break
                elif isinstance(cmd, ds.CommitP2P):
                    for k in batch[s]:
                        committed.setdefault((k, s), clock[s])
                    peers = [committed.get((k, r)) for k in batch[s] for r in (k[1], k[2]) if r != s]
                    if any(t is None for t in peers):
                        break
                    clock[s] = max([clock[s], *peers])
                    batch[s] = []
                elif type(cmd) in cost:
                    phase = cmd.kwargs.get("phase", 0)
                    slot = (phase, cmd.buffer_id)
                    if isinstance(cmd, ds.ForwardPass):
                        micro_batch[s][slot] = forwards[s][phase]
                        forwards[s][phase] += 1
                    kind = {ds.ForwardPass: "F", ds.BackwardPass: "B", WeightPass: "W"}[type(cmd)]
                    end = clock[s] + cost[type(cmd)]
                    out.spans.append(Span(s, clock[s], end, kind, micro_batch[s].get(slot, -1), phase))
                    clock[s] = end
                pc[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(
                f"{name}: the instruction lists deadlock at {pc} ({stages} stages, {micro_batches} micro-batches)"
            )
    out.finish = clock
    return out


def _p2p_keys(stage: int, program: list) -> list[tuple | None]:
    """Per instruction: its point-to-point key (kind, sender, receiver, n-th such message), or None."""
    counters: dict[tuple, int] = {}
    keys: list[tuple | None] = []
    for cmd in program:
        if not isinstance(cmd, (ds.SendActivation, ds.RecvActivation, ds.SendGrad, ds.RecvGrad)):
            keys.append(None)
            continue
        phase = cmd.kwargs.get("phase", 0)
        downstream, upstream = (stage + 1, stage - 1) if phase == 0 else (stage - 1, stage + 1)
        activation = isinstance(cmd, (ds.SendActivation, ds.RecvActivation))
        send = isinstance(cmd, (ds.SendActivation, ds.SendGrad))
        other = (downstream if send else upstream) if activation else (upstream if send else downstream)
        src, dst = (stage, other) if send else (other, stage)
        base = ("act" if activation else "grad", src, dst, phase)
        n = counters.get((base, send), 0)
        counters[(base, send)] = n + 1
        keys.append((*base, n))
    return keys
