"""`mlc-cli eval --tasks`: lm-evaluation-harness tasks from local YAML files, scored in-process by the engine.

The model is lm-eval's `TemplateLM` over mlc's offline `LLM`: the same tokenization as lm-eval's
`local-completions` client (no special tokens, the context cut to `max_length - 1` tokens from the left), and
loglikelihoods from the engine's prompt logprobs, so a task scores the same here as through `mlc-cli serve`.
`is_greedy` is checked by greedy decoding of the continuation (the engine scores given tokens, not alternatives).
Tasks never touch a hub: each YAML names its data (e.g. `dataset_path: json` with `data_files`), and relative paths
are read from the task file's folder.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import yaml

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ConfigError, DataError


def _lm_eval():
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise ConfigError("mlc-cli eval --tasks needs lm-eval, part of the optional extra mlc[eval]: "
                          "install `mlc[eval]` (pip install 'mlc[eval]')") from None
    return TemplateLM


def make_lm(llm: LLM, max_length: int | None = None, max_gen_toks: int = 256, batch_size: int = 16):
    """An lm-eval model backed by `llm`."""
    TemplateLM: Any = _lm_eval()  # a base class imported on demand (lm-eval is an optional extra)

    class MlcLM(TemplateLM):
        def __init__(self):
            super().__init__()
            self.llm = llm
            self.tokenizer = llm.tokenizer
            self.max_length = (max_length or llm.engine.max_seq_len) - 1  # one token for generation, as the client
            self.max_gen_toks = max_gen_toks
            self.batch_size = batch_size

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            out = []
            for i in range(0, len(requests), self.batch_size):
                out += self._score(requests[i : i + self.batch_size])
            return out

        def _score(self, chunk) -> list[tuple[float, bool]]:
            jobs, ctxlens, conts = [], [], []
            for _, ctx, cont in chunk:
                inp = (ctx + cont)[-self.max_length :]
                ctxlen = len(ctx) - max(0, len(ctx) + len(cont) - self.max_length)
                jobs.append(inp)
                ctxlens.append(ctxlen)
                conts.append(inp[ctxlen:])
            scoring = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True)
            outs = self.llm.generate(jobs, scoring)
            greedy = self.llm.generate([j[:c] for j, c in zip(jobs, ctxlens)],
                                       [SamplingParams(max_new_tokens=len(c), temperature=0.0, ignore_eos=True)
                                        for c in conts])
            results = []
            for out, ctxlen, cont, g in zip(outs, ctxlens, conts, greedy):
                lps = out.prompt_logprobs or []  # token k's logprob at index k - 1
                results.append((float(sum(lps[ctxlen - 1 : ctxlen - 1 + len(cont)])),
                                list(g.outputs[0].token_ids) == cont))
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            totals = []
            for (string,) in [req.args for req in requests]:
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)]
                scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
                totals.append(sum(s for s, _ in scored))
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            prompts, params = [], []
            for context, gen_kwargs in [req.args for req in requests]:
                kwargs = dict(gen_kwargs)
                until = kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                eos = self.tokenizer.decode([self.eot_token_id])
                limit = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
                ids = self.tok_encode(context)[-max(1, self.max_length - limit):]
                temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
                prompts.append(ids)
                params.append(SamplingParams(max_new_tokens=limit, temperature=temperature,
                                             stop=[s for s in [*until, eos] if s][:16]))
            return [o.outputs[0].text for o in self.llm.generate(prompts, params)]

    return MlcLM()


def task_names(paths: list[Path]) -> tuple[list[str], list[Path]]:
    """(task names, folders to include) from task YAML files or folders of them."""
    names, folders = [], []
    for path in paths:
        files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise DataError(f"--tasks {path}: no task YAML there; give a .yaml task file or a folder of them")
        for f in files:
            text = f.read_text(encoding="utf-8")
            spec = yaml.load(text, Loader=_TaskLoader) or {}
            if isinstance(spec, dict) and isinstance(spec.get("task"), str):
                names.append(spec["task"])
        folders.append(path if path.is_dir() else path.parent)
    if not names:
        raise DataError(f"no `task:` name in {', '.join(map(str, paths))}; each task YAML needs one")
    return names, list(dict.fromkeys(folders))


class _TaskLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs for their names only: `!function` tags are kept as text."""


_TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def run_tasks(llm: LLM, paths: list[Path], limit: int | None = None, num_fewshot: int | None = None,
              batch_size: int = 16) -> dict:
    """lm-eval's results dict for the tasks in `paths`."""
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    names, folders = task_names([Path(p).resolve() for p in paths])
    manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    with _cwd(folders[0]):  # relative data_files are read from the task file's folder
        results = simple_evaluate(model=make_lm(llm, batch_size=batch_size), tasks=names, task_manager=manager,
                                  limit=limit, num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    if results is None:
        raise DataError("lm-eval returned no results")
    return results


@contextlib.contextmanager
def _cwd(path: Path):
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)
