#!/usr/bin/env python3
"""docs/CONFORMANCE.md from target/conformance/results.json (tests/conformance.rs).

Usage: python3 tools/conformance/report.py [results.json] [out.md]
"""
import collections
import json
import sys

src = sys.argv[1] if len(sys.argv) > 1 else "target/conformance/results.json"
out = sys.argv[2] if len(sys.argv) > 2 else "docs/CONFORMANCE.md"
res = json.load(open(src))

DOCUMENTED = {
    "refused: value-dependent": "a shape depends on input values",
    "refused: other-domain": "a domain other than the default",
    "refused: unsupported-type": "a type memplan does not model (strings, maps, sequences)",
}
kinds = collections.OrderedDict()
for name, r in res.items():
    kinds.setdefault(name.split("/")[0], collections.Counter())[r["outcome"]] += 1
total = collections.Counter(r["outcome"] for r in res.values())
n = len(res)
ok = total["match"] + sum(total[k] for k in DOCUMENTED)

lines = []
w = lines.append
w("# Conformance: the ONNX backend test suite")
w("")
w("Every model of the test data shipped in the onnx 1.22.0 wheel, through")
w("loading, shape inference and (where the CPU executor runs it) the forward pass.")
w("Each output's dtype, shape and values are compared with the model's `test_data_set_0`.")
w("")
w("- Run: `tools/conformance/fetch.sh`, then `cargo test --release --test conformance`.")
w("- This file: `python3 tools/conformance/report.py`.")
w("- The test holds the results to `tests/data/conformance/baseline.json`:")
w("  - a model that matched must still match;")
w("  - no model may panic;")
w("  - no model may give a new wrong dtype, shape or value;")
w("  - at least 95 % must match or be refused for a documented reason, with none wrong and none panicking.")
w("")
w(f"**{n} models:**")
w(f"- {total['match']} match;")
w(f"- {ok - total['match']} are refused for a documented reason;")
w(f"- together, {ok} ({100 * ok / n:.1f} %);")
w(f"- {total['wrong']} give a wrong dtype, shape or value;")
w(f"- {total['panic']} panic.")
w("")
vals = collections.Counter()
for r in res.values():
    if r["outcome"] == "match":
        d = r["detail"]
        if d == "values equal":
            vals["equal"] += 1
        else:
            why = d.removeprefix("values not compared: ")
            if "has no kernel" in why:
                why = "an op without a CPU kernel"
            elif "cannot hold" in why:
                why = "a type the CPU executor does not hold (8-bit, float64, ...)"
            elif "random" in why:
                why = "random values"
            vals[why] += 1
w(f"**Values.** Where the CPU executor runs a matching model on the suite's inputs, its outputs are compared with the expected values (relative 1e-4 plus an absolute 1e-6; float16 and bfloat16 add their rounding, 2^-10 and 2^-7; four models whose expected values are written to 4 decimals by hand (two of them RoiAlign), 5e-5 absolute plus the relative 1e-4): {vals['equal']} of the {total['match']} matches are compared and equal. Not compared:")
for why, c in vals.most_common():
    if why != "equal":
        w(f"- {c}: {why};")
w("")
# The value-dependent models run again with their small inputs as constants.
fold = collections.Counter()
fold_not = []
for name, r in res.items():
    f = r.get("folded")
    if f is None:
        continue
    if f.startswith("match: values equal"):
        fold["equal"] += 1
    elif f.startswith("match"):
        fold["not compared"] += 1
    else:
        key = f.split(":")[0]
        fold[key] += 1
        fold_not.append((name, f))
nfold = sum(fold.values())
w(f"**Value-dependent models with their inputs as constants.** Each model refused as value-dependent runs again with the suite's values of its small inputs (integers, booleans and float tensors of rank 0 or 1: the shapes, sizes, scales, rois, axes and conditions the suite feeds as graph inputs) made constants, the rest fed as before. The outcome stays the refusal (a user's model holds no such values); the run checks the kernels on them, and the test allows no wrong value there: of {nfold}, {fold['equal']} compare values equal, {fold['not compared']} infer but are not compared (a type or op the CPU executor does not run), and these do not infer or run:")
for name, f in sorted(fold_not):
    w(f"- `{name}`: {f};")
w("")
w("| outcome | " + " | ".join(kinds) + " | all |")
w("|---|" + "---|" * (len(kinds) + 1))
for o in sorted(total, key=lambda o: -total[o]):
    w(f"| {o} | " + " | ".join(str(c[o]) for c in kinds.values()) + f" | {total[o]} |")
w("")
w("**Outcomes.**")
w("- `match`: every output has the expected dtype and shape (and values, where compared).")
w("- `refused: value-dependent`: a shape, an If condition, a Loop trip count or a sequence split that depends on input values (often the suite feeds a shape or a condition as a graph input); control flow and sequences that fold are lowered to plain ops (src/lower.rs).")
w("- `refused: other-domain`: only ops of another domain are missing.")
w("- `refused: unsupported-type`: strings, maps, sequences.")
w("- `refused: unsupported-op`: an op of the default domain memplan has no rule for yet. It is not a documented reason: issue 13's ops work.")
w("- `wrong`: an output's dtype, shape or values differ.")
w("- `error`: any other failure, with its message below.")
w("")

# Unsupported ops, by how many models they stop.
miss = collections.Counter()
for r in res.values():
    if r["outcome"] == "refused: unsupported-op":
        d = r["detail"].removeprefix("unsupported ops: ")
        for part in d.split(", "):
            miss[part.split(" (node")[0]] += 1
w("## Unsupported ops, by models they stop")
w("")
w(", ".join(f"{op} {c}" for op, c in miss.most_common()))
w("")

# Per-op pass rates over the models that load (node tests name one op each).
per_op = collections.defaultdict(collections.Counter)
for r in res.values():
    for op in r.get("ops", []):
        per_op[op][r["outcome"]] += 1
w("## Per op: models containing it, and how many match")
w("")
w("| op | models | match | refused (documented) | other |")
w("|---|---|---|---|---|")
for op in sorted(per_op):
    c = per_op[op]
    m = sum(c.values())
    doc = sum(c[k] for k in DOCUMENTED)
    w(f"| {op} | {m} | {c['match']} | {doc} | {m - c['match'] - doc} |")
w("")
w("## Every model that does not match")
w("")
for o in sorted(o for o in total if o != "match"):
    w(f"### {o} ({total[o]})")
    w("")
    for name, r in res.items():
        if r["outcome"] == o:
            d = r["detail"].replace("|", "\\|").replace("\n", " ")
            if len(d) > 200:
                d = d[:200] + "…"
            w(f"- `{name}`: {d}")
    w("")
open(out, "w").write("\n".join(lines))
print(f"{out}: {n} models, {total['match']} match, {ok} match or documented")
