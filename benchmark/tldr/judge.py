"""Win rate of a policy's TL;DR summaries against the dataset's reference summaries, judged by an LLM.

    python benchmark/tldr/judge.py --model_name_or_path models/rloo_tldr --output_path runs/tldr/judge.json
    python benchmark/tldr/judge.py --model_name_or_path models/rloo_tldr --base_url http://localhost:8000/v1 --model M

The first asks OpenAI (OPENAI_API_KEY set); the second any OpenAI-compatible server, e.g. `vllm serve M --port 8000`.
TRL's examples/scripts/evals/judge_tldr.py flags are taken: --judge_model (= --model), --num_examples None (all).

1. Summarize the first --num_examples posts of the split with the policy (greedy by default): with vLLM when
   it is installed, else with rloo.py's sampler in batches. The vLLM path needs a GPU and is not covered by
   the tests (they run on CPU, without vLLM).
2. For each post, ask the judge which of the two summaries is better, with the prompt of the published TL;DR
   evaluations (DPO paper, N+ implementation details); the policy's summary is Summary A or B by a seeded
   coin flip, so the judge's position bias cancels out on average.
3. win rate = (wins + ties / 2) / examples; an answer without a parseable `Preferred: A|B` line is a tie.

The judge's answers are cached in --cache_path (JSONL, appended after each answer), keyed by the judge model
and the full prompt: an interrupted run resumes where it stopped, and a rerun on the same inputs sends nothing.
"""

import hashlib
import http.client
import importlib.util
import json
import math
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import torch
import tyro
from rich.progress import track

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # `python benchmark/tldr/judge.py` only puts benchmark/tldr/ on the path

import plumbing
import rloo  # noqa: E402

WRITER = "benchmark/tldr/judge.py"  # the mark of its outputs: a path that exists is written only if it has it


@dataclass
class Args:
    model_name_or_path: str
    """the policy to evaluate (Hub id or local directory, with its tokenizer)"""
    dataset_name: str = "trl-lib/tldr"
    """Hub dataset id, a local .jsonl/.json/.parquet file, or a `save_to_disk` directory"""
    dataset_config: Optional[str] = None
    """the Hub dataset's configuration name, if it has several"""
    dataset_split: str = "validation"
    """split to evaluate on (ignored for a single local file)"""
    prompt_column: str = "prompt"
    """column with the post as the policy sees it: "SUBREDDIT: ... TITLE: ... POST: ... TL;DR:" """
    completion_column: str = "completion"
    """column with the reference summary"""
    num_examples: Optional[int] = 1000
    """evaluate on the first this many rows of the split (all of them if it has fewer); None: all (TRL's default)"""
    response_length: int = 53
    """tokens generated per summary at most; generation stops at EOS"""
    temperature: float = 0.0
    """sampling temperature of the policy; 0 is greedy"""
    batch_size: int = 32
    """prompts per generation batch (transformers path)"""
    use_vllm: bool = True
    """generate with vLLM when it is installed; False always uses transformers"""
    trust_remote_code: bool = False
    """allow models and tokenizers with custom code from the Hub"""
    base_url: str = "https://api.openai.com/v1"
    """the judge's OpenAI-compatible API; requests go to {base_url}/chat/completions"""
    model: Annotated[str, tyro.conf.arg(aliases=("--judge-model",))] = "gpt-4o-mini"
    """the judge model (TRL's judge_tldr.py: --judge_model); a Hub id (owner/name) needs --base_url of a server that
    runs it: TRL asks Hugging Face's inference API, e.g. --base_url https://router.huggingface.co/v1 --api_key_env
    HF_TOKEN, or `vllm serve` it"""
    api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the API key; unset sends no Authorization header (local servers)"""
    seed: int = 0
    """seed of the A/B order of each pair (and of sampling when temperature > 0)"""
    cache_path: str = ".cache/judge/cache.jsonl"
    """the judge's answers, keyed by judge model and prompt; reused across runs"""
    output_path: Optional[str] = None
    """JSON file for the result; the summaries and judgements go next to it, in <stem>.summaries.jsonl"""
    max_retries: int = 5
    """retries of a request after a connection error, a timeout, HTTP 429 or 5xx"""
    backoff: float = 1.0
    """seconds before the first retry, doubled at each retry (plus up to 50% jitter, at most 60 s)"""
    timeout: float = 60.0
    """seconds per request"""
    num_workers: int = 8
    """requests in flight at once"""


OPENAI = Args.__dataclass_fields__["base_url"].default


# ===================================================================== judging prompt and answers
JUDGE_PROMPT = """Which of the following summaries does a better job of summarizing the most important points in the given forum post, without including unimportant or irrelevant details? A good summary is both precise and concise.

Post:
{post}

Summary A:
{summary_a}

Summary B:
{summary_b}

FIRST provide a one-sentence comparison of the two summaries, explaining which you prefer and why. SECOND, on a new line, state only "A" or "B" to indicate your choice. Your response should use the format:
Comparison: <one-sentence comparison and explanation>
Preferred: <"A" or "B">"""

# a whole line `Preferred: A`, tolerating markdown emphasis, quotes and brackets around the parts
PREFERRED_LINE = re.compile(r"""^[\s*_#>]*preferred[\s*_]*:[\s*_"'<(\[]*([ab])[\s*_"'>)\].]*$""",
                            re.IGNORECASE | re.MULTILINE)


def post_text(prompt: str) -> str:
    """The forum post of a TL;DR prompt: its SUBREDDIT/TITLE/POST text without the trailing "TL;DR:"."""
    return prompt.strip().removesuffix("TL;DR:").rstrip()


def judge_prompt(post: str, summary_a: str, summary_b: str) -> str:
    return JUDGE_PROMPT.format(post=post, summary_a=summary_a, summary_b=summary_b)


def parse_preference(answer: str) -> Optional[str]:
    """"A" or "B" from the last `Preferred:` line of the judge's answer; None when there is none."""
    matches = PREFERRED_LINE.findall(answer)
    return matches[-1].upper() if matches else None


def policy_first(num_examples: int, seed: int) -> list[bool]:
    """Per example, True when the policy's summary is Summary A (probability 1/2, seeded)."""
    rng = random.Random(seed)
    return [rng.random() < 0.5 for _ in range(num_examples)]


def outcome(preferred: Optional[str], policy_is_a: bool) -> float:
    """1 when the judge preferred the policy's summary, 0 when the reference, 0.5 when the answer is unparseable."""
    if preferred is None:
        return 0.5
    return float((preferred == "A") == policy_is_a)


def win_rate(outcomes: list[float]) -> dict:
    """Wins, losses, ties (unparseable answers), the win rate with ties as half a win, and its standard error."""
    n = len(outcomes)
    rate = sum(outcomes) / n
    variance = sum((o - rate) ** 2 for o in outcomes) / max(n - 1, 1)
    return {"win_rate": rate, "win_rate_stderr": math.sqrt(variance / n), "num_examples": n,
            "wins": outcomes.count(1.0), "losses": outcomes.count(0.0), "ties": outcomes.count(0.5)}


# ===================================================================== judge client
MAX_BACKOFF = 60.0  # seconds


class JudgeError(plumbing.ConfigError):
    """The judge's endpoint cannot be reached or refuses the requests; reported as one line, exit status 2."""


def cache_key(model: str, prompt: str) -> str:
    return hashlib.sha256(json.dumps([model, prompt]).encode()).hexdigest()


def http_error_message(error: urllib.error.HTTPError) -> str:
    """The server's own message, as inert text on one line: the OpenAI error body's `error.message`, else the start
    of the body."""
    body = error.read(1 << 16).decode(errors="replace")
    try:
        return plumbing.inert(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return plumbing.inert(body) or plumbing.inert(error.reason)


class JudgeClient:
    """Chat completions at temperature 0 from an OpenAI-compatible endpoint, with retries and a JSONL cache.

    Thread-safe: `complete` may be called from several threads. `num_requests` counts HTTP requests sent
    (retries included), `num_cached` the answers taken from the cache."""

    def __init__(self, base_url: str, model: str, api_key: Optional[str], cache_path: str, max_retries: int,
                 backoff: float, timeout: float):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key
        self.max_retries, self.backoff, self.timeout = max_retries, backoff, timeout
        self.cache_path = Path(cache_path)
        self.cache = self._read_cache()
        self.num_requests = self.num_cached = 0
        self._lock = threading.Lock()

    def _read_cache(self) -> dict[str, str]:
        if not self.cache_path.exists():
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            return {}
        text = self.cache_path.read_text()
        cache = {}
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # the unfinished last line of an interrupted run
                continue
            if isinstance(record, dict) and isinstance(record.get("key"), str):  # the first line: the signature
                cache[record["key"]] = record.get("answer")
        if text and not text.endswith("\n"):  # end that line, so the next record starts on its own
            with plumbing.open_own(self.cache_path) as f:
                f.write("\n")
        return cache

    def complete(self, prompt: str) -> str:
        key = cache_key(self.model, prompt)
        with self._lock:
            if key in self.cache:
                self.num_cached += 1
                return self.cache[key]
        answer = self._request(prompt)
        with self._lock:
            self.cache[key] = answer
            with plumbing.open_own(self.cache_path) as f:
                if f.tell() == 0:  # a new cache, signed on its first line (check_outputs: judge.py's own)
                    f.write(json.dumps({"written_by": WRITER}) + "\n")
                f.write(json.dumps({"key": key, "model": self.model, "answer": answer}) + "\n")
        return answer

    def _request(self, prompt: str) -> str:
        payload = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=headers, method="POST")
        for attempt in range(self.max_retries + 1):
            with self._lock:
                self.num_requests += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read()
                break
            except urllib.error.HTTPError as e:
                failure = f"HTTP {e.code}: {http_error_message(e)}"
                if e.code != 429 and e.code < 500:
                    hint = " - check the API key (--api_key_env)" if e.code in (401, 403) else ""
                    raise JudgeError(f"{self.url} refused the request with {failure}{hint}") from None
            except (OSError, http.client.HTTPException) as e:  # refused, reset, DNS, timeout, bad status line
                failure = f"{type(e).__name__}: {plumbing.inert(getattr(e, 'reason', None) or e)}"
            if attempt < self.max_retries:
                time.sleep(min(MAX_BACKOFF, self.backoff * 2**attempt) * random.uniform(1.0, 1.5))
        else:
            raise JudgeError(
                f"no answer from {self.url} after {self.max_retries + 1} attempts ({failure}): start an "
                "OpenAI-compatible server there (e.g. `vllm serve MODEL`) or pass --base_url URL --model MODEL "
                "(OpenAI: the default --base_url with OPENAI_API_KEY set); slow servers may need a larger --timeout"
            )
        try:
            return json.loads(body)["choices"][0]["message"]["content"] or ""  # null content (a refusal): a tie
        except (ValueError, KeyError, IndexError, TypeError):
            answer = plumbing.inert(body.decode(errors="replace"))
            raise JudgeError(f"{self.url} answered without choices[0].message.content: {answer}") from None


def judge_all(client: JudgeClient, prompts: list[str], num_workers: int) -> list[str]:
    """The judge's answers in the order of the prompts, num_workers requests in flight; the first failure
    cancels the requests not yet started and is raised."""
    with ThreadPoolExecutor(num_workers) as pool:
        futures = [pool.submit(client.complete, prompt) for prompt in prompts]
        try:
            for future in track(as_completed(futures), total=len(futures), description="judging"):
                future.result()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [future.result() for future in futures]


# ===================================================================== summaries
def load_examples(args: Args) -> tuple[list[str], list[str]]:
    """The prompts and reference summaries of the first num_examples rows."""
    dataset = plumbing.load_split(args.dataset_name, args.dataset_split, args.dataset_config)
    missing = [c for c in (args.prompt_column, args.completion_column) if c not in dataset.column_names]
    if missing:
        raise plumbing.ConfigError(
            f"dataset {args.dataset_name} has no column {' or '.join(map(repr, missing))}; its columns are "
            f"{dataset.column_names}: pass --prompt_column NAME and --completion_column NAME"
        )
    if len(dataset) == 0:
        raise plumbing.ConfigError(f"dataset {args.dataset_name} (split {args.dataset_split!r}) is empty")
    dataset = dataset.select(range(len(dataset) if args.num_examples is None else min(args.num_examples, len(dataset))))
    return list(dataset[args.prompt_column]), [c.strip() for c in dataset[args.completion_column]]


def vllm_summaries(args: Args, prompts: list[str]) -> list[str]:
    """Summaries from vLLM (needs a GPU; not exercised by the tests)."""
    from vllm import LLM, SamplingParams

    llm = LLM(args.model_name_or_path, trust_remote_code=args.trust_remote_code, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.response_length, seed=args.seed)
    return [output.outputs[0].text.strip() for output in llm.generate(prompts, params)]


def transformers_summaries(args: Args, tokenizer, prompts: list[str]) -> list[str]:
    """Summaries from rloo.py's sampler, batch_size prompts at a time, prompts of similar length together."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy = plumbing.load_causal_lm(args.model_name_or_path, torch.float32, args.trust_remote_code)
    plumbing.ensure_pad_token(tokenizer, "[PAD]", policy.get_input_embeddings().num_embeddings, args.model_name_or_path)
    plumbing.disable_dropout(policy)
    policy.to(device).eval()
    torch.manual_seed(args.seed)
    ids = tokenizer(prompts)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))  # less padding per batch
    summaries = [""] * len(prompts)
    for start in track(range(0, len(order), args.batch_size), description="generating"):
        batch = order[start : start + args.batch_size]
        queries, query_mask = plumbing.pad_sequences([ids[i] for i in batch], tokenizer.pad_token_id,
                                                     device)  # (B, Tq) each
        completions = rloo.sample_completions(policy, queries, query_mask, args.response_length, args.temperature,
                                              tokenizer.eos_token_id, tokenizer.pad_token_id)
        for i, response, mask in zip(batch, completions.responses, completions.response_mask):  # (Tr,) each
            summaries[i] = tokenizer.decode(response[mask], skip_special_tokens=True).strip()
    return summaries


def generate_summaries(args: Args, prompts: list[str]) -> list[str]:
    tokenizer = plumbing.load_tokenizer(args.model_name_or_path, args.trust_remote_code)  # a wrong path fails here
    if args.use_vllm and importlib.util.find_spec("vllm") is not None:
        return vllm_summaries(args, prompts)
    return transformers_summaries(args, tokenizer, prompts)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """The rows, one JSON line each, the first signed (`written_by`: a later call replaces its own file only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"written_by": WRITER, **row} if i == 0 else row for i, row in enumerate(rows)]
    plumbing.write_own(path, "".join(json.dumps(row) + "\n" for row in rows))


# ===================================================================== main
def main(args: Args) -> dict:
    if min(args.num_examples or 1, args.batch_size, args.num_workers, args.response_length) < 1:
        raise plumbing.ConfigError("num_examples, batch_size, num_workers and response_length must be >= 1")
    if args.temperature < 0 or args.max_retries < 0:
        raise plumbing.ConfigError("temperature and max_retries must be >= 0")
    if "/" in args.model and args.base_url == OPENAI:
        raise plumbing.ConfigError(f"--judge_model {args.model} is a Hub model, which OpenAI's API does not serve: "
                                   "pass --base_url of a server that runs it (Hugging Face's inference API, as TRL's "
                                   "judge_tldr.py: --base_url https://router.huggingface.co/v1 --api_key_env HF_TOKEN; "
                                   "or `vllm serve` it), or an OpenAI model (gpt-4o-mini)")
    summaries_path = None if args.output_path is None else \
        Path(args.output_path).with_name(Path(args.output_path).stem + ".summaries.jsonl")
    inputs = [("--dataset_name", Path(args.dataset_name)), ("--model_name_or_path", Path(args.model_name_or_path))]
    plumbing.check_outputs([("--cache_path", Path(args.cache_path))], inputs, WRITER)
    plumbing.check_outputs([("--output_path", Path(path)) for path in (args.output_path, summaries_path) if path],
                           [*inputs, ("--cache_path", Path(args.cache_path))], WRITER)
    plumbing.quiet_hub_progress_bars()
    prompts, references = load_examples(args)
    summaries = generate_summaries(args, prompts)
    rows = [{"prompt": p, "reference": r, "summary": s} for p, r, s in zip(prompts, references, summaries)]
    if summaries_path is not None:  # written now too, so a failed judging step keeps the generations
        write_jsonl(summaries_path, rows)

    firsts = policy_first(len(rows), args.seed)
    judge_prompts = []
    for row, first in zip(rows, firsts):
        summary_a, summary_b = (row["summary"], row["reference"]) if first else (row["reference"], row["summary"])
        judge_prompts.append(judge_prompt(post_text(row["prompt"]), summary_a, summary_b))
    client = JudgeClient(args.base_url, args.model, os.environ.get(args.api_key_env), args.cache_path,
                         args.max_retries, args.backoff, args.timeout)
    answers = judge_all(client, judge_prompts, args.num_workers)
    outcomes = []
    for row, first, answer in zip(rows, firsts, answers):
        preferred = parse_preference(answer)
        outcomes.append(outcome(preferred, first))
        row.update(policy_is_a=first, judgement=answer, preferred=preferred, outcome=outcomes[-1])

    result = {**win_rate(outcomes), "judge_model": args.model, "model_name_or_path": args.model_name_or_path,
              "dataset_name": args.dataset_name, "dataset_split": args.dataset_split,
              "temperature": args.temperature, "response_length": args.response_length, "seed": args.seed}
    print(f"judged {result['num_examples']} pairs with {args.model} at {args.base_url}: {client.num_requests} "
          f"HTTP requests (retries included), {client.num_cached} answers from the cache {args.cache_path}")
    print(f"win rate of {args.model_name_or_path} vs the reference summaries: {result['win_rate']:.3f} "
          f"+- {result['win_rate_stderr']:.3f} (wins {result['wins']}, losses {result['losses']}, "
          f"ties {result['ties']} = unparseable answers)")
    if args.output_path is not None:
        write_jsonl(summaries_path, rows)
        plumbing.write_own(Path(args.output_path), json.dumps({"written_by": WRITER, **result}, indent=2) + "\n")
        print(f"wrote {args.output_path} and {summaries_path}")
    return result


def cli() -> None:
    plumbing.run_tool("judge.py", Args, main)


if __name__ == "__main__":
    cli()
