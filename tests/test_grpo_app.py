"""torchforge's GRPO app (apps/grpo/main.py at 6e77f0b, with PR #486's episode samples) as
a job of four processes, its observability through metric_core.torchforge: the actors'
Tracers, their record_metric calls, record_episode_sample, and torchforge's
``metric_logging`` config (a ``global_reduce`` W&B backend, offline here, and a ``console``
one). What lands is checked against what the processes recorded: the W&B run read back from
the real client's offline files, ``metriclog reduce`` and ``metriclog samples``.

The app below keeps the observability lines of torchforge's code as they are, only their
import lines changed (``forge.observability...`` -> ``metric_core.torchforge...``). What
monarch, torchstore, vLLM and torch do is played by stand-ins: each actor is a process
(rank) of its own that drives its own metric logger, as docs/compat.md's "A job, as
torchforge writes it" has it; the controller calls the actors' endpoints over a socket;
the weights go through files; the model is a numpy table of logits; timers are CPU ones
(no GPU, no torch). Without monarch no logger reaches the actors' processes, so the
controller tells each actor the step it flushes, after its own flush (torchforge's
GlobalLoggingActor does that fan-out through monarch).

The truth: a runner around the app wraps ``record_metric`` (the one the app, the Tracer and
record_episode_sample call) and the collector's ``flush`` to write every value and every
flushed step to a truth file, before handing the value on; numpy over those values is
what W&B and ``metriclog reduce`` must show."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from .wandb_file import find_run_file, history_rows, read_records, tables_of

REPO = Path(__file__).resolve().parents[1]
METRICLOG = str(Path(sys.executable).with_name("metriclog"))
ROLES = ["Controller", "Generator", "ReferenceModel", "TitanTrainer"]  # rank = index
STEPS = 4
SAMPLES = "main_samples/continuous_rollouts/sample_table"

APP = r'''
import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any, Callable

import numpy as np

from metric_core.torchforge.metric_actors import get_or_create_metric_logger
from metric_core.torchforge.metrics import record_episode_sample, record_metric, Reduce
from metric_core.torchforge.perf_tracker import Tracer, trace

# ---- stand-ins for monarch, torchstore, vLLM, torch (not torchforge's observability) ---- #
VOCAB, PROMPTS = 6, 5
STORE = Path(os.environ["GRPO_STORE"])
ADDRESS = os.environ["GRPO_ADDRESS"]
METRIC_LOGGING = {  # apps/grpo/qwen3_1_7b.yaml's metric_logging, W&B offline
    "wandb": {
        "project": "grpo-training",
        "group": "grpo_exp_test",
        "logging_mode": "global_reduce",
        "mode": "offline",
    },
    "console": {"logging_mode": "global_reduce"},
}


def endpoint(f):
    return f


def endpoints(call):
    """monarch's ways of calling an endpoint, all of them ``call`` here."""
    ways = {way: staticmethod(call) for way in ("route", "call_one", "call", "fanout")}
    return type("Endpoint", (), ways)()


class ForgeActor:
    pass


class Remote:
    """An actor in another process: ``await actor.method.route(...)`` (or call_one, call,
    fanout) sends the call and waits for its answer."""

    def __init__(self, conn):
        self.conn = conn

    def __getattr__(self, name):
        conn = self.conn

        async def call(*args, **kwargs):
            conn.send((name, args, kwargs))
            return conn.recv()

        return endpoints(call)


class Local(Remote):
    """An actor in the controller's process, called the same way."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        return endpoints(getattr(self.actor, name))


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compute_logprobs(weights, prompt_ids, response):
    """Each response token's log-probability under the prompt's row of logits."""
    return np.take_along_axis(log_softmax(weights[prompt_ids]), response, axis=1)


@dataclass
class Completion:
    prompt_id: int
    text: str
    token_ids: np.ndarray
    generator_version: int


# ---- torchforge's GRPO app (apps/grpo/main.py), its model and data numpy stand-ins ---- #
@dataclass
class Episode:
    episode_id: str
    pad_id: int
    request_len: int
    response_len: int
    target: Any | None = None
    request: str | None = None
    response: str | None = None
    completion: Completion | None = None
    ref_logprobs: np.ndarray | None = None
    reward: float | None = None
    reward_breakdown: dict[str, float] | None = None
    advantage: float | None = None

    @property
    def policy_version(self) -> int | None:
        return self.completion.generator_version

    def to_dict(self, exclude: list[str] | None = None) -> dict[str, Any]:
        result = {
            "episode_id": self.episode_id,
            "policy_version": self.policy_version,
            "prompt": self.request,
            "response": self.response,
            "target": str(self.target),
            "reward": self.reward,
            "advantage": self.advantage,
            "request_len": self.request_len,
            "response_len": self.response_len,
            "pad_id": self.pad_id,
            "ref_logprobs": self.ref_logprobs,
            "completion": self.completion,
        }
        if self.reward_breakdown is not None and "reward_breakdown" not in (exclude or []):
            result.update(self.reward_breakdown)
        for key in exclude or []:
            result.pop(key, None)
        return result


Group = list[Episode]


def collate(batches: list[Group]):
    inputs, targets = [], []
    for batch in batches:
        inputs.append({"prompt_ids": np.array([e.completion.prompt_id for e in batch])})
        targets.append({
            "response": np.stack([e.completion.token_ids for e in batch]),
            "ref_logprobs": np.stack([e.ref_logprobs for e in batch]),
            "advantages": np.array([[e.advantage] for e in batch]),
        })
    return inputs, targets


def simple_grpo_loss(logprobs, ref_logprobs, advantages, beta=0.1):
    kl = np.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1
    per_token_loss = -(advantages - beta * kl)
    return float(per_token_loss.mean(axis=1).mean())


def MathReward(prompt, response, target):
    return float(np.mean([int(t) == int(target) for t in response.split()]))


def ThinkingReward(prompt, response, target):
    return 1.0 if response.split()[0] == "0" else 0.0


@dataclass
class RewardActor(ForgeActor):
    reward_functions: list[Callable]

    @endpoint
    async def evaluate_response(self, prompt: str, response: str, target: str) -> float:
        total_rewards = 0.0
        for reward_fn in self.reward_functions:
            reward = reward_fn(prompt, response, target)
            total_rewards += reward
            reward_fn_name = getattr(reward_fn, "__name__", reward_fn.__class__.__name__)
            record_metric(f"reward/evaluate_response/sum_{reward_fn_name}_reward", reward, Reduce.SUM)
            record_metric(f"reward/evaluate_response/avg_{reward_fn_name}_reward", reward, Reduce.MEAN)
            record_metric(f"reward/evaluate_response/std_{reward_fn_name}_reward", reward, Reduce.STD)
            record_metric("reward/evaluate_response/avg_total_reward", reward, Reduce.MEAN)
            record_metric(f"reward/evaluate_response/count_{reward_fn_name}_calls", 1, Reduce.SUM)
        avg_reward = total_rewards / len(self.reward_functions)
        return avg_reward


@dataclass
class ComputeAdvantages(ForgeActor):
    @endpoint
    async def compute(self, group: Group) -> list[float]:
        rewards = np.array([[e.reward for e in group]])
        mean = rewards.mean(1, keepdims=True)
        std = rewards.std(1, ddof=1, keepdims=True)
        advantages = (rewards - mean) / (std + 1e-4)
        return advantages.squeeze(0).tolist()


@dataclass
class DatasetActor(ForgeActor):
    @endpoint
    async def setup(self):
        self._epoch = 0
        self._rng = np.random.default_rng(0)
        self._iterator = iter(range(0))

    @endpoint
    async def sample(self) -> dict[str, str] | None:
        try:
            sample = next(self._iterator)
            record_metric("dataset/sample/count_samples_generated", 1, Reduce.SUM)
            record_metric("dataset/sample/avg_sample_len", len(sample["request"]), Reduce.MEAN)
            record_metric("dataset/sample/current_epoch", self._epoch, Reduce.MAX)
            return sample
        except StopIteration:
            self._epoch += 1
            order = self._rng.permutation(PROMPTS)
            prompts = [{"request": f"{p} + {p % 2}", "target": str((p + p % 2) % VOCAB)} for p in order]
            self._iterator = iter(prompts)
            return await self.sample()

    @endpoint
    async def pad_token(self):
        return 0


@dataclass
class Generator(ForgeActor):
    n: int = 4
    max_tokens: int = 3

    @endpoint
    async def setup(self):
        self.weights, self.version, self.rng = np.zeros((PROMPTS, VOCAB)), 0, np.random.default_rng(1)

    @endpoint
    async def generate(self, prompt: str) -> list[Completion]:
        t = Tracer("generator_perf/generate", timer="cpu")
        t.start()
        record_metric("generator/generate/count_requests", 1, Reduce.SUM)
        prompt_id = int(prompt.split()[0])
        probs = np.exp(log_softmax(self.weights[prompt_id]))
        t.step("process_inputs")
        tokens = self.rng.choice(VOCAB, size=(self.n, self.max_tokens), p=probs)
        completions = [Completion(prompt_id, " ".join(map(str, row)), row, self.version) for row in tokens]
        t.step("generate")
        record_metric("generator/generate/count_sequences_completed", len(completions), Reduce.SUM)
        for completion in completions:
            num_generated_tokens = len(completion.token_ids)
            record_metric("generator/generate/sum_tokens_generated", num_generated_tokens, Reduce.SUM)
            record_metric("generator/generate/avg_tokens_generated", num_generated_tokens, Reduce.MEAN)
        t.stop()
        return completions

    @endpoint
    async def update_weights(self, version: int) -> None:
        t = Tracer("generator_perf/_fetch_weights")
        t.start()
        self.weights = np.load(STORE / f"weights-{version}.npy")
        t.stop()
        self.version = version
        record_metric("generator/update_weights/count_weight_updates", 1, Reduce.SUM)


@dataclass
class ReferenceModel(ForgeActor):
    @endpoint
    async def setup(self):
        self.weights = np.zeros((PROMPTS, VOCAB))

    @endpoint
    async def forward(self, input_ids, max_req_tokens: int, return_logprobs: bool):
        record_metric("reference_perf/forward/count_forward_passes", 1, Reduce.SUM)
        record_metric("reference_perf/forward/avg_sequence_length", input_ids.shape[1], Reduce.MEAN)
        t = Tracer("reference_perf/forward", timer="cpu", track_memory=False)
        t.start()
        prompt_ids, response = input_ids[:, 0], input_ids[:, max_req_tokens:]
        t.step("to_device")
        logits = log_softmax(self.weights[prompt_ids])
        t.step("forward")
        logprobs = np.take_along_axis(logits, response, axis=1)
        t.step("compute_logprobs")
        t.stop()
        return logprobs


@dataclass
class ReplayBuffer(ForgeActor):
    batch_size: int = 4
    max_policy_age: int = 1
    collate: Callable | None = None

    @endpoint
    async def setup(self):
        self.buffer = []

    @endpoint
    async def add(self, episode: Episode) -> None:
        self.buffer.append(episode)
        record_metric("buffer/add/count_episodes_added", 1, Reduce.SUM)

    @endpoint
    @trace("buffer_perf/sample", track_memory=False)
    async def sample(self, curr_policy_version: int):
        record_metric("buffer/sample/count_sample_requests", 1, Reduce.SUM)
        buffer_size = len(self.buffer)
        if buffer_size < self.batch_size:
            return None
        batch = [self.buffer.pop(0) for _ in range(self.batch_size)]
        record_metric("buffer/sample/avg_data_utilization", self.batch_size / buffer_size, Reduce.MEAN)
        ages = [curr_policy_version - e.policy_version for e in batch]
        record_metric("buffer/sample/avg_sampled_policy_age", sum(ages) / len(ages), Reduce.MEAN)
        record_metric("buffer/sample/max_sampled_policy_age", max(ages), Reduce.MAX)
        record_metric("buffer/sample/min_sampled_policy_age", min(ages), Reduce.MIN)
        return self.collate([batch])


@dataclass
class TitanTrainer(ForgeActor):
    learning_rate: float = 0.5

    @endpoint
    async def setup(self):
        self.weights = np.zeros((PROMPTS, VOCAB))

    @endpoint
    async def train_step(self, inputs, targets) -> float:
        t = Tracer("rl_trainer_perf/step", timer="cpu", track_memory=False)
        t.start()
        (inputs,), (targets,) = inputs, targets
        prompt_ids, response = inputs["prompt_ids"], targets["response"]
        logprobs = compute_logprobs(self.weights, prompt_ids, response)
        loss = simple_grpo_loss(logprobs, targets["ref_logprobs"], targets["advantages"])
        probs = np.exp(log_softmax(self.weights[prompt_ids]))
        grads = np.zeros_like(self.weights)
        for i, p in enumerate(prompt_ids):
            onehot = np.eye(VOCAB)[response[i]].mean(axis=0)
            grads[p] -= targets["advantages"][i, 0] * (onehot - probs[i])
        t.step("forward_backward")
        current_lr = self.learning_rate
        self.weights -= current_lr * grads
        record_metric("rl_trainer/learning_rate", current_lr, Reduce.MIN)
        t.step("optimizer_step")
        record_metric("rl_trainer/avg_loss", loss, Reduce.MEAN)
        t.stop()
        return loss

    @endpoint
    async def push_weights(self, policy_version: int) -> None:
        t = Tracer("rl_trainer_perf/push_weights", timer="cpu", track_memory=False)
        t.start()
        flat = self.weights.copy()
        t.step("flatten_state_dict")
        np.save(STORE / f"weights-{policy_version}.npy", flat)
        t.step("ts_save")
        t.stop()


async def drop_weights(version: int):
    (STORE / f"weights-{version}.npy").unlink()


async def serve(actor, process_name):
    """An actor's process: its own metric logger, then the controller's calls."""
    mlogger = await get_or_create_metric_logger(process_name=process_name)
    await mlogger.init_backends.call_one(METRIC_LOGGING)
    await actor.setup()
    conn = Client(ADDRESS)
    conn.send(process_name)
    while True:
        name, args, kwargs = conn.recv()
        if name == "flush":
            await mlogger.flush.call_one(*args)
            conn.send(None)
        elif name == "shutdown":
            await mlogger.shutdown.call_one()
            conn.send(None)
            return
        else:
            conn.send(await getattr(actor, name)(*args, **kwargs))


async def main():
    """Main GRPO training loop with rollout and training processes."""
    group_size, max_req_tokens, max_res_tokens, max_steps = 4, 1, 3, int(os.environ["GRPO_STEPS"])

    metric_logging_cfg = METRIC_LOGGING
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one(metric_logging_cfg)

    listener = Listener(ADDRESS)
    remote = {}
    for _ in range(3):
        conn = listener.accept()
        remote[conn.recv()] = Remote(conn)
    policy, ref_model, trainer = remote["Generator"], remote["ReferenceModel"], remote["TitanTrainer"]
    dataloader, replay_buffer = Local(DatasetActor()), Local(ReplayBuffer(collate=collate))
    compute_advantages = Local(ComputeAdvantages())
    reward_actor = Local(RewardActor(reward_functions=[MathReward, ThinkingReward]))
    await dataloader.setup.call_one()
    await replay_buffer.setup.call_one()

    print("All services initialized successfully!")
    shutdown_event = asyncio.Event()

    # ---- Core RL loops ---- #
    async def continuous_rollouts():
        rollout_count = 0
        pad_id = await dataloader.pad_token.call_one()
        while not shutdown_event.is_set():
            t = Tracer("main_perf/continuous_rollouts")
            t.start()
            sample = await dataloader.sample.call_one()
            if sample is None:
                print("Dataloader is empty, exiting continuous rollout")
                return

            t.step("data_loading")

            prompt, target = sample["request"], sample["target"]
            responses: list[Completion] = await policy.generate.route(prompt)
            t.step("policy_generation")

            # Construct episodes and calculate rewards
            episodes = []
            input_ids = np.ones((group_size, max_req_tokens + max_res_tokens), dtype=np.int64)
            for i, response in enumerate(responses):
                episode = Episode(
                    episode_id=str(uuid.uuid4()),
                    pad_id=pad_id,
                    request_len=max_req_tokens,
                    response_len=max_res_tokens,
                    target=target,
                    request=prompt,
                    response=response.text,
                    completion=response,
                )
                episode.reward_breakdown = {
                    fn.__name__: fn(prompt, response.text, target) for fn in (MathReward, ThinkingReward)
                }
                episode.reward = await reward_actor.evaluate_response.route(
                    prompt=prompt, response=response.text, target=target
                )
                episodes.append(episode)

                # Build input_ids for reference logprobs
                input_ids[i, :max_req_tokens] = response.prompt_id
                input_ids[i, max_req_tokens:] = response.token_ids

            t.step("reward_evaluation")

            ref_logprobs = await ref_model.forward.route(input_ids, max_req_tokens, return_logprobs=True)
            t.step("reference_model_calculate_logprobs")

            for i, episode in enumerate(episodes):
                episode.ref_logprobs = ref_logprobs[i]
            del ref_logprobs, input_ids

            advantages = await compute_advantages.compute.call_one(episodes)
            for episode, advantage in zip(episodes, advantages):
                episode.advantage = advantage
                await replay_buffer.add.call_one(episode)

                # Log sample-level data
                record_episode_sample("main_samples/continuous_rollouts/sample_table", episode)

            rollout_count += 1
            record_metric("main/continuous_rollouts/count_rollout_iterations", 1, Reduce.SUM)
            t.stop()
            await asyncio.sleep(0)  # the other loop runs between rollouts, as monarch's awaits let it

    async def continuous_training():
        training_step = 0
        restart_tracer = True  # Flag to control when to restart tracer

        while max_steps == -1 or training_step < max_steps:
            # Restart tracer when needed (initial start or after completing a training step)
            # Otherwise, we cannot measure time waiting for buffer
            if restart_tracer:
                t = Tracer("main_perf/continuous_training")
                t.start()
                restart_tracer = False

            batch = await replay_buffer.sample.call_one(curr_policy_version=training_step)
            if batch is None:
                await asyncio.sleep(0.01)
            else:
                t.step("waiting_for_buffer")

                inputs, targets = batch
                await trainer.train_step.call(inputs, targets)
                training_step += 1
                t.step("train_step")

                await trainer.push_weights.call(training_step)
                t.step("push_weights")

                await policy.update_weights.fanout(training_step)
                t.step("update_weights")

                if training_step >= 2:
                    await drop_weights(training_step - 1)
                    t.step("drop_weights")

                t.stop()
                restart_tracer = True

                # Flush metrics every training step to WandB
                await mlogger.flush.call_one(training_step)
                for actor in remote.values():  # monarch's fan-out of the flush to the actors
                    await actor.flush.call_one(training_step)

        print(f"Reached training limit ({max_steps} steps). Exiting continuous_training loop.")

    rollout_tasks = [asyncio.create_task(continuous_rollouts())]
    training_task = asyncio.create_task(continuous_training())

    try:
        await training_task
    finally:
        print("Shutting down... (this may take a few seconds)")
        shutdown_event.set()
        await asyncio.wait_for(asyncio.gather(*rollout_tasks, return_exceptions=True), timeout=60)
        for actor in remote.values():
            await actor.shutdown.call_one()
        await mlogger.shutdown.call_one()


role = sys.argv[1]
if role == "Controller":
    asyncio.run(main())
else:
    asyncio.run(serve(globals()[role](), role))
'''

# Before the app runs: every value handed to record_metric (by the app, a Tracer or
# record_episode_sample) and every flushed step goes to the truth file, in order.
RUNNER = r"""
import json, os, runpy, sys
import metric_core.torchforge as tf
from metric_core.torchforge import metrics, perf_tracker

truth = open(os.environ["GRPO_TRUTH"], "w", buffering=1)
real_record, real_flush = metrics.record_metric, metrics.MetricCollector.flush

def record_metric(key, value, reduction=metrics.Reduce.MEAN):
    shown = value if isinstance(value, dict) else float(value)
    truth.write(json.dumps(["record", key, shown, metrics.Reduce(reduction).value]) + "\n")
    real_record(key, value, reduction)

async def flush(self, global_step, return_state=False):
    truth.write(json.dumps(["flush", global_step]) + "\n")
    return await real_flush(self, global_step, return_state=return_state)

metrics.record_metric = tf.record_metric = perf_tracker.record_metric = record_metric
metrics.MetricCollector.flush = flush
sys.argv = [sys.argv[1], sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

HOW = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min, "std": np.std}


def truth(tmp_path: Path) -> tuple[dict[tuple[int, str], list[float]], dict[str, str], list[dict]]:
    """From the truth files: the values of each (step, key) over every process, each key's
    reduction, and every sample. A value belongs to the step of the next flush; those after
    the last flush, to the step after it (the collector's step at shutdown)."""
    values: dict[tuple[int, str], list[float]] = {}
    reductions: dict[str, str] = {}
    samples: list[dict] = []
    for role in ROLES:
        lines = [json.loads(line) for line in (tmp_path / f"truth-{role}.jsonl").read_text().splitlines()]
        flushes = [line[1] for line in lines if line[0] == "flush"]
        assert flushes == list(range(1, STEPS + 1)), (role, flushes)
        pending: list = []
        for line in [*lines, ["flush", STEPS + 1]]:
            if line[0] == "flush":
                for _, key, value, how in pending:
                    if how == "sample":
                        samples.append({"step": line[1], "key": key, **value})
                    else:
                        values.setdefault((line[1], key), []).append(value)
                        assert reductions.setdefault(key, how) == how, key
                pending = []
            else:
                pending.append(line)
    return values, reductions, samples


def expected(values, reductions) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for (step, key), vs in values.items():
        out.setdefault(step, {})[key] = float(HOW[reductions[key]](np.array(vs, dtype=np.float64)))
    return out


def run_job(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (tmp_path / "store").mkdir()
    app = tmp_path / "grpo_main.py"
    app.write_text(APP)
    # a Unix socket's path has a short limit: the address is not under tmp_path
    address = Path(tempfile.mkdtemp(prefix="grpo")) / "controller"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "FORGE_DISABLE_METRICS", "METRICLOG_DIR")}
    env.update(
        METRICLOG_DIR=str(run),
        WORLD_SIZE=str(len(ROLES)),
        WANDB_SILENT="true",
        PYTHONPATH=str(REPO),
        GRPO_STORE=str(tmp_path / "store"),
        GRPO_ADDRESS=str(address),
        GRPO_STEPS=str(STEPS),
    )
    procs: dict[str, subprocess.Popen] = {}
    try:
        for rank, role in enumerate(ROLES):
            if rank == 1:  # the actors connect to the controller's socket once it listens
                deadline = time.monotonic() + 120
                while not address.exists():
                    assert procs["Controller"].poll() is None, (tmp_path / "Controller.err").read_text()
                    assert time.monotonic() < deadline, "the controller did not listen"
                    time.sleep(0.02)
            with open(tmp_path / f"{role}.out", "w") as out, open(tmp_path / f"{role}.err", "w") as err:
                procs[role] = subprocess.Popen(
                    [sys.executable, "-c", RUNNER, str(app), role],
                    cwd=tmp_path,
                    env={**env, "RANK": str(rank), "GRPO_TRUTH": str(tmp_path / f"truth-{role}.jsonl")},
                    stdout=out,
                    stderr=err,
                )
        for role, p in procs.items():
            assert p.wait(timeout=300) == 0, (role, (tmp_path / f"{role}.err").read_text())
    finally:  # a failed process leaves the others waiting on the socket: they are ended
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    shutil.rmtree(address.parent)
    return run


@pytest.mark.slow
def test_torchforges_grpo_app_on_four_processes_lands_as_numpy_over_what_they_recorded(tmp_path):
    run = run_job(tmp_path)
    values, reductions, samples = truth(tmp_path)
    want = expected(values, reductions)

    # torchforge's Tracer names, for every Tracer the app and its actors run
    keys = set(reductions)
    for prefix, steps in {
        "main_perf/continuous_rollouts": [
            "data_loading",
            "policy_generation",
            "reward_evaluation",
            "reference_model_calculate_logprobs",
        ],
        "main_perf/continuous_training": [
            "waiting_for_buffer",
            "train_step",
            "push_weights",
            "update_weights",
            "drop_weights",
        ],
        "generator_perf/generate": ["process_inputs", "generate"],
        "reference_perf/forward": ["to_device", "forward", "compute_logprobs"],
        "rl_trainer_perf/step": ["forward_backward", "optimizer_step"],
        "rl_trainer_perf/push_weights": ["flatten_state_dict", "ts_save"],
    }.items():
        names = {f"{prefix}/total_duration_avg_s": "mean", f"{prefix}/total_duration_max_s": "max"}
        for step in steps:
            names |= {f"{prefix}/{step}/duration_avg_s": "mean", f"{prefix}/{step}/duration_max_s": "max"}
        assert {k: reductions.get(k) for k in names} == names
    for prefix in ("generator_perf/_fetch_weights", "buffer_perf/sample"):
        assert {k for k in keys if k.startswith(prefix)} == {
            f"{prefix}/total_duration_avg_s",
            f"{prefix}/total_duration_max_s",
        }

    # W&B, offline: the sidecar's global run, one row a step, numpy over every process's values
    ledger = json.loads((run / ".metriclog" / "uploads.json").read_text())["runs"]
    ((run_id, entry),) = ledger.items()
    assert entry["finished"], entry
    rows = history_rows(read_records(find_run_file(run / ".metriclog" / "wandb", run_id)))
    assert [row["step"] for row in rows] == sorted(want)
    for row in rows:
        scalars = {k: v for k, v in row.items() if not k.startswith(("_", "step", SAMPLES))}
        assert set(scalars) == set(want[row["step"]]), row["step"]
        for key, value in want[row["step"]].items():
            assert scalars[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (row["step"], key)

    # its samples tables: each step's bottom 2 and top 2 by reward over the step's episodes
    tables = tables_of(find_run_file(run / ".metriclog" / "wandb", run_id), SAMPLES)
    by_step: dict[int, list[dict]] = {}
    for sample in samples:
        by_step.setdefault(sample["step"], []).append(sample)
    assert sorted(tables) == sorted(by_step)
    for step, shown in tables.items():
        rewards = sorted(s["reward"] for s in by_step[step])
        assert sorted(row["reward"] for row in shown) == sorted(rewards[:2] + rewards[-2:]), step
        ids = {s["episode_id"]: s for s in by_step[step]}
        for row in shown:
            assert row["advantage"] == ids[row["episode_id"]]["advantage"], step

    # metriclog reduce on the run directory: the same
    done = subprocess.run(
        [METRICLOG, "reduce", str(run), "--mode", "GLOBAL_REDUCE", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    reduced = json.loads(done.stdout)
    got = {(r["step"], r["key"]): r["value"] for r in reduced}
    assert got.keys() == values.keys()
    for (step, key), value in got.items():
        assert value == pytest.approx(want[step][key], rel=1e-12, abs=1e-12), (step, key)

    # every episode recorded with record_episode_sample is listed by metriclog samples
    done = subprocess.run(
        [METRICLOG, "samples", str(run), "--format", "json"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert len(samples) == sum(1 for s in samples) > 0
    assert {s["key"] for s in listed} == {"main_samples/continuous_rollouts/sample_table"}
    assert {s["process"] for s in listed} == {"Controller_r0"}
    fields = [k for k in samples[0] if k != "key"]
    assert sorted(tuple(s[k] for k in fields) for s in listed) == sorted(
        tuple(s[k] for k in fields) for s in samples
    )

    # the console backend in global_reduce: rank 0's console shows each step's block once,
    # its values numpy's over what every process recorded; no other process prints one
    blocks = re.findall(
        r"=== \[global_reduce\] - METRICS STEP (\d+) ===\n(.*?)\n={30}\n",
        (tmp_path / "Controller.err").read_text(),
        flags=re.S,
    )
    assert [int(step) for step, _ in blocks] == sorted(want)
    for step, body in blocks:
        shown = dict(line.strip().split(": ", 1) for line in body.splitlines())
        assert shown.keys() == want[int(step)].keys(), step
        for key, value in want[int(step)].items():
            assert float(shown[key]) == pytest.approx(value, rel=1e-12, abs=1e-12), (step, key)
    for role in ROLES:
        if role != "Controller":
            assert "METRICS STEP" not in (tmp_path / f"{role}.err").read_text(), role

    # no process failed anywhere, the sidecar and the console backend included
    for role in ROLES:
        assert "Traceback" not in (tmp_path / f"{role}.err").read_text(), role
    assert "sidecar" not in (tmp_path / "Controller.err").read_text()  # it ended well, waited for
