"""Finding 7 of the vLLM issue: a training script without `if __name__ == "__main__":`.

The rollout worker is a spawned process, which re-imports the training script. Before, such a script's
spawned worker died and the trainer blocked forever inside Process.start(); now it fails within seconds
with a message naming the guard: at train() when the script trains at import time, and when the worker
dies while it starts when the script only builds its trainer at import time, or trains from a helper
the import-time check cannot see, with a dataset too large to fit in the pipe spawn writes into.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

HEAD = """
from datasets import Dataset

from harness import AsyncGRPOTrainer
from harness.config import AsyncGRPOConfig


def length_reward(completion_ids, **kwargs):
    return [float(len(ids) % 3) for ids in completion_ids]


args = AsyncGRPOConfig(
    output_dir={out!r}, max_steps=1, num_generations=2, max_completion_length=4, save_strategy="no",
    report_to="none", disable_tqdm=True, gradient_checkpointing=False, generation_server="builtin",
    builtin_server_max_model_len=128,
)
data = Dataset.from_dict({{"prompt": [[{{"role": "user", "content": "hi"}}]] * 4}})
trainer = AsyncGRPOTrainer({model!r}, reward_funcs=length_reward, args=args, train_dataset=data)
"""


def run_script(tmp_path, model_dir: str, tail: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train_script.py"
    script.write_text(textwrap.dedent(HEAD).format(out=str(tmp_path / "out"), model=model_dir) + tail)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_a_script_that_trains_at_import_time_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    done = run_script(tmp_path, tiny_model_dir, "trainer.train()\n")
    assert done.returncode != 0
    assert "trains at import time" in done.stderr and 'if __name__ == "__main__":' in done.stderr
    assert "train_script.py, line" in done.stderr


def test_a_trainer_built_at_import_time_fails_the_worker_with_the_guard_named(tmp_path, tiny_model_dir):
    done = run_script(tmp_path, tiny_model_dir, 'if __name__ == "__main__":\n    trainer.train()\n')
    assert done.returncode != 0
    assert "a trainer was created inside the rollout worker" in done.stderr  # the worker's own error
    assert "RolloutWorkerError" in done.stderr and 'if __name__ == "__main__":' in done.stderr


def test_a_helper_that_trains_at_import_time_with_a_large_dataset_fails_instead_of_hanging(
    tmp_path, tiny_model_dir
):
    # The check at train() looks for `.train(` at the top level only; here a helper trains. The dataset
    # (about 400 kB pickled) is far more than a pipe holds, which is what made Process.start() hang.
    tail = (
        "def run():\n"
        "    big = Dataset.from_dict({'prompt': [[{'role': 'user', 'content': 'hi ' * 20}]] * 4000})\n"
        f"    trainer = AsyncGRPOTrainer({tiny_model_dir!r}, reward_funcs=length_reward, args=args,\n"
        "                               train_dataset=big)\n"
        "    trainer.train()\n"
        "run()\n"
    )
    done = run_script(tmp_path, tiny_model_dir, tail)
    assert done.returncode != 0
    assert "a trainer was created inside the rollout worker" in done.stderr
    assert "RolloutWorkerError" in done.stderr and 'if __name__ == "__main__":' in done.stderr
    assert not list(tmp_path.glob("agent-harness-worker-*"))
