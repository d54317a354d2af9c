"""Structured output (issue 31): validity over many JSON schemas, and the cost per output token
of a grammar-constrained request vs an unconstrained one, same run.

- validity: ``--schemas`` JSON schemas from a seeded generator (nested objects, enums, arrays
  with bounds, integers and numbers with bounds, bounded strings, booleans), one greedy SmolLM2
  generation each, constrained and free; an output counts as valid when it parses and validates.
- overhead: batch 1 and ``--batch`` requests of ``--new`` tokens each, temperature 0 and 0.8,
  unconstrained (``ignore_eos``) vs constrained by a schema that cannot end within ``--new``
  tokens (so both modes produce exactly as many tokens); seconds per output token, best of
  ``--reps`` interleaved runs; plus the two per-step parts alone (mask fill per token; stack +
  apply of a batch mask).
- ``--jump-forward``: instead, jump-forward on the schema-heavy workload (the validity set's
  schemas, greedy, one request at a time and all at once), two engines in the same run with
  ``jump_forward_tokens`` 16 and 0, interleaved: engine steps (forward passes), output tokens,
  tok/s, jump-forward tokens proposed / accepted, and whether the outputs are the same tokens.

- ``--peer llama-cpp``: instead of the above, treeserve constrained vs llama.cpp's ``json_schema``
  (llama-cpp-python on the same GGUF file) on the same held schemas and prompt token ids, one
  request at a time (llama-cpp-python is single-stream), greedy, ``--peer-max-tokens`` each,
  ``--threads`` each, interleaved per schema: tok/s (prefill included) and validity; a schema
  llama.cpp's converter rejects is reported as its failure.

Run: ``python benches/bench_structured.py [--schemas 24] [--batch 64] [--new 32] [--reps 3] [--jump-forward]``,
``python benches/bench_structured.py --peer llama-cpp [--schemas 24] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import replace

import jsonschema
import torch

from treeserve import LLM, SamplingParams
from treeserve._cpu import cpu_features
from treeserve.sampling import StructuredOutput, apply_token_bitmask_, stack_bitmasks

NAMES = ["id", "name", "price", "tags", "owner", "size", "color", "count", "valid", "meta", "items", "score"]
LONG = {"type": "array", "minItems": 500, "items": {"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["word", "n"], "additionalProperties": False}}  # fmt: skip


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of the generator's subset (objects at the top)."""
    kinds = ["int", "num", "str", "enum", "bool"] + (["obj", "arr"] if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "obj"
    if kind == "int":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if kind == "num":
        lo = rng.choice([0, -1, 10])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 100, 1e4])}
    if kind == "str":
        return {"type": "string", "maxLength": rng.randint(3, 20)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "small", "large", "n/a"], rng.randint(2, 4))}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "arr":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 4)}
    props = {n: random_schema(rng, depth + 1) for n in rng.sample(NAMES, rng.randint(2, 4))}
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def invalid_reason(text: str, schema: dict) -> str | None:
    """Why ``text`` is not a JSON document valid against ``schema`` (None when it is)."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError as e:
        return f"not JSON: {e.msg}"
    except jsonschema.ValidationError as e:
        return f"at {list(e.absolute_path)}: {e.message}"
    return None


def valid(text: str, schema: dict) -> bool:
    return invalid_reason(text, schema) is None


def held_set(llm: LLM, num: int) -> tuple[list[dict], list[list[int]]]:
    """The held schemas (seeded generator) and their chat prompts as token ids."""
    rng = random.Random(31)
    schemas = [random_schema(rng) for _ in range(num)]
    tok = llm.tokenizer
    asks = [f"Reply with only a JSON object matching this JSON schema: {json.dumps(s)}" for s in schemas]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}])) for a in asks]
    return schemas, prompts


def validity(llm: LLM, num: int) -> None:
    schemas, prompts = held_set(llm, num)
    for constrained in (False, True):
        sps = [SamplingParams(temperature=0, max_new_tokens=192, structured={"json_schema": s} if constrained else None)
               for s in schemas]  # fmt: skip
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ok = sum(valid(o.outputs[0].text, s) for o, s in zip(outs, schemas))
        stops = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"validity {'constrained' if constrained else 'free       '}: {ok}/{num} valid, {stops} ended by "
              f"themselves, {tokens} tokens in {seconds:.1f} s")  # fmt: skip


def per_token(llm: LLM, batch: int, new: int, temperature: float, constrained: bool) -> float:
    prompts = [f"Question {i}: list words and numbers." for i in range(batch)]
    sp = SamplingParams(temperature=temperature, seed=1, max_new_tokens=new, ignore_eos=not constrained,
                        structured={"json_schema": LONG} if constrained else None)  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new for o in outs), "a request ended early"
    return seconds / (batch * new)


def overhead(llm: LLM, batches: list[int], new: int, reps: int) -> None:
    for batch in batches:
        for temperature in (0.0, 0.8):
            best = {False: float("inf"), True: float("inf")}
            for _ in range(reps):  # interleaved: both modes see the same machine load
                for constrained in (False, True):
                    best[constrained] = min(best[constrained], per_token(llm, batch, new, temperature, constrained))
            print(f"batch {batch:3d} temperature {temperature}: free {1e3 * best[False]:7.2f} ms/token, constrained "
                  f"{1e3 * best[True]:7.2f} ms/token, overhead {100 * (best[True] / best[False] - 1):+6.1f}%")  # fmt: skip


def parts(llm: LLM, batch: int) -> None:
    """The constrained path's own work: a matcher's accept + mask refill, and a batch mask's stack
    + in-place apply over the logits (what the sampling path runs)."""
    compiler = llm.grammar_compiler()
    state = compiler.new_state(StructuredOutput(json_schema=LONG))
    text = json.dumps([{"word": "tea", "n": i} for i in range(60)])[:-2]  # LONG cannot close yet
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    t0 = time.perf_counter()
    for t in ids:
        assert state.accept(t)
    fill = (time.perf_counter() - t0) / len(ids)
    masks = [state.bitmask] * batch
    logits = torch.randn(batch, llm.vocab_size)
    t0 = time.perf_counter()
    for _ in range(20):
        apply_token_bitmask_(logits, stack_bitmasks(masks, llm.vocab_size, "cpu"))
    apply = (time.perf_counter() - t0) / 20
    print(f"parts: accept + mask refill {1e3 * fill:.3f} ms per token; stack + apply at batch {batch}: "
          f"{1e3 * apply:.2f} ms per step")  # fmt: skip


def jump_forward(num: int, reps: int) -> None:
    """Forward passes and tok/s with and without jump-forward, same run (see the module doc)."""
    engines = {j: LLM(max_batched_tokens=4096, enable_prefix_cache=False, jump_forward_tokens=j, speculative=None)
               for j in (16, 0)}  # fmt: skip
    schemas, prompts = held_set(engines[0], num)
    sps = [SamplingParams(temperature=0, max_new_tokens=192, structured={"json_schema": s}) for s in schemas]
    for llm in engines.values():
        llm.generate(prompts[:2], sps[:2], use_tqdm=False)  # warm-up (compiles the grammars)
    for label, groups in (("batch 1", [[i] for i in range(num)]), (f"batch {num}", [list(range(num))])):
        best = {j: float("inf") for j in engines}
        best_tpot: dict[int, float] = {}
        res = {}
        for _ in range(reps):  # interleaved: both engines see the same machine load
            for j, llm in engines.items():
                m0 = replace(llm.metrics)
                t0 = time.perf_counter()
                ids = [o.outputs[0].token_ids for g in groups
                       for o in llm.generate([prompts[i] for i in g], [sps[i] for i in g], use_tqdm=False)]  # fmt: skip
                best[j] = min(best[j], time.perf_counter() - t0)
                m = llm.metrics
                tpot = (m.tpot_sum - m0.tpot_sum) / max(m.tpot_count - m0.tpot_count, 1)
                best_tpot[j] = min(best_tpot.get(j, float("inf")), tpot)
                res[j] = (ids, m.steps - m0.steps, m.jump_forward_proposed - m0.jump_forward_proposed,
                          m.jump_forward_tokens - m0.jump_forward_tokens)  # fmt: skip
        tokens = sum(len(t) for t in res[0][0])
        for j in engines:
            _, steps, proposed, accepted = res[j]
            print(f"jump-forward {label} jump_forward_tokens={j:2d}: {steps} steps, {tokens} tokens, "
                  f"{tokens / best[j]:.1f} tok/s end to end, {1e3 * best_tpot[j]:.1f} ms per token after the "
                  f"first (TPOT), forced proposed {proposed} accepted {accepted}")  # fmt: skip
        print(f"jump-forward {label}: TPOT x{best_tpot[0] / best_tpot[16]:.2f}")
        print(f"jump-forward {label}: steps saved {1 - res[16][1] / res[0][1]:.1%}, tok/s x{best[0] / best[16]:.2f}, "
              f"same tokens: {res[16][0] == res[0][0]}")  # fmt: skip


def peer_llama_cpp(llm: LLM, num: int, max_tokens: int, threads: int) -> None:
    """treeserve constrained vs llama-cpp-python's ``json_schema`` grammar, batch 1, same prompts.

    llama.cpp's side is ``LlamaGrammar.from_json_schema`` (what ``create_chat_completion``'s
    ``response_format={"type": "json_object", "schema": ...}`` builds) passed to
    ``create_completion`` with the same prompt token ids, so both systems see identical prompts.
    """
    from llama_cpp import Llama, LlamaGrammar

    from treeserve.models import resolve_model_path

    schemas, prompts = held_set(llm, num)
    peer = Llama(str(resolve_model_path("smollm2-135m-instruct")), n_threads=threads, n_threads_batch=threads,
                 n_ctx=2048, verbose=False, seed=0)  # fmt: skip
    peer.create_completion(prompts[0][:8], max_tokens=2, temperature=0.0)  # warm-up, outside the measurement
    totals = {"treeserve": [0, 0.0, 0], "llama.cpp": [0, 0.0, 0]}  # tokens, seconds, valid
    for i, (schema, ids) in enumerate(zip(schemas, prompts)):
        sp = SamplingParams(temperature=0, max_new_tokens=max_tokens, structured={"json_schema": schema})
        t0 = time.perf_counter()
        out = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0]
        seconds, why = time.perf_counter() - t0, invalid_reason(out.text, schema)
        ours = (len(out.token_ids), seconds, why is None, out.finish_reason + (f"; {why}" if why else ""))
        try:
            grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        except Exception as e:  # noqa: BLE001 -- the converter's own failure is the result reported
            theirs: tuple = (0, 0.0, False, f"grammar error: {type(e).__name__}: {e}")
        else:
            t0 = time.perf_counter()
            res = peer.create_completion(ids, max_tokens=max_tokens, temperature=0.0, grammar=grammar, seed=0)
            choice = res["choices"][0]
            seconds, why = time.perf_counter() - t0, invalid_reason(choice["text"], schema)
            theirs = (res["usage"]["completion_tokens"], seconds, why is None,
                      choice["finish_reason"] + (f"; {why}; {choice['text'][:100]!r}" if why else ""))  # fmt: skip
        for name, r in (("treeserve", ours), ("llama.cpp", theirs)):
            totals[name] = [totals[name][0] + r[0], totals[name][1] + r[1], totals[name][2] + r[2]]
        line = "; ".join(f"{n} {r[0]:3d} tok {r[1]:6.2f} s valid {r[2]!s:5} ({r[3]})"
                         for n, r in (("treeserve", ours), ("llama.cpp", theirs)))  # fmt: skip
        print(f"schema {i:2d}: {line}", flush=True)
    for name, (tokens, seconds, ok) in totals.items():
        print(f"peer {name:9}: {ok}/{num} valid, {tokens} tokens in {seconds:.1f} s, "
              f"{tokens / max(seconds, 1e-9):.1f} tok/s")  # fmt: skip
    ours_rate, theirs_rate = (totals[n][0] / max(totals[n][1], 1e-9) for n in ("treeserve", "llama.cpp"))
    print(f"peer ratio: treeserve / llama.cpp tok/s = {ours_rate / max(theirs_rate, 1e-9):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--schemas", type=int, default=24)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jump-forward", action="store_true", help="measure jump-forward only")
    ap.add_argument("--peer", choices=["llama-cpp"], default=None, help="only the peer comparison (see above)")
    ap.add_argument("--peer-max-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    f = cpu_features()
    print(f"CPU: {f.model_name} ({platform.machine()}, torch ISA {f.torch_capability}), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    if args.jump_forward:
        jump_forward(args.schemas, args.reps)
        return
    # jump-forward and speculation off: the overhead is the per-token cost of the mask, like for like
    llm = LLM(max_batched_tokens=4096, enable_prefix_cache=False, jump_forward_tokens=0, speculative=None,
              num_threads=args.threads)  # fmt: skip
    llm.generate(["warm-up"], SamplingParams(max_new_tokens=2, structured={"regex": "[a-z]+"}), use_tqdm=False)
    if args.peer == "llama-cpp":
        peer_llama_cpp(llm, args.schemas, args.peer_max_tokens, args.threads)
        return
    parts(llm, args.batch)
    overhead(llm, [1, args.batch], args.new, args.reps)
    validity(llm, args.schemas)


if __name__ == "__main__":
    main()
