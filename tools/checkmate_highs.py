#!/usr/bin/env python3
"""Dev tool (not used by memplan): Checkmate's MILP (Jain et al. 2020, lower-triangular
stages) for a random layered graph of tests/data/remat-graphs, solved with HiGHS (pip install
highspy). Gives the proven optimum that docs/BENCHMARKS.md compares the planner with, and the
optimal R (computed per stage) and S (kept into each stage) in OUT.json.

usage: python3 tools/checkmate_highs.py GRAPH.json BUDGET_FRACTION TIME_LIMIT_S OUT.json
"""
import json, sys, highspy, numpy as np
g = json.load(open(sys.argv[1])); frac = float(sys.argv[2]); tl = float(sys.argv[3])
order = g['graph']['order']; pos = {v: i for i, v in enumerate(order)}
nodes = {nd['name']: nd for nd in g['nodes']}
n = len(order)
m = [nodes[order[i]]['out_cost'] for i in range(n)]
c = [nodes[order[i]]['duration'] for i in range(n)]
deps = [[] for _ in range(n)]; users = [[] for _ in range(n)]
for l in g['links']:
    u, v = pos[l['0']], pos[l['1']]
    if u not in deps[v]: deps[v].append(u); users[u].append(v)
for d in deps: d.sort()
for u in users: u.sort()
# no-remat peak
live = set(); cur = 0; peak = 0
last = [max(users[i]) if users[i] else i for i in range(n)]
for k in range(n):
    cur += m[k]; live.add(k); peak = max(peak, cur)
    for i in list(live):
        if last[i] <= k: live.discard(i); cur -= m[i]
budget = frac * peak
print('n', n, 'peak', peak, 'budget', budget, flush=True)
h = highspy.Highs(); h.setOptionValue('time_limit', tl); h.setOptionValue('threads', 2)
inf = highspy.kHighsInf
cols = 0; lo = []; up = []; cost = []; integ = []
def var(cst=0.0, ub=1.0, integer=True):
    global cols
    lo.append(0.0); up.append(ub); cost.append(cst); integ.append(integer); cols += 1; return cols - 1
R = {}; S = {}; F = {}; U = {}
for t in range(n):
    for i in range(t + 1):
        R[t, i] = var(c[i] if i < t else 0.0)
    for i in range(t):
        S[t, i] = var()
rows = []  # (idx list, val list, lo, hi)
for t in range(n):
    rows.append(([R[t, t]], [1.0], 1.0, 1.0))
    for k in range(t + 1):
        for i in deps[k]:
            rows.append(([R[t, k], R[t, i], S[t, i]], [1.0, -1.0, -1.0], -inf, 0.0))
    if t + 1 < n:
        for i in range(t + 1):
            idx = [S[t + 1, i], R[t, i]] + ([S[t, i]] if i < t else [])
            rows.append((idx, [1.0, -1.0] + ([-1.0] if i < t else []), -inf, 0.0))
for t in range(n):
    for k in range(t + 1):
        for i in deps[k] + [k]:
            later = [j for j in users[i] if j > k and j <= t]
            f = var(); F[t, i, k] = f
            hz = [(R[t, k], -1.0)] + ([(S[t + 1, i], 1.0)] if t + 1 < n else []) + [(R[t, j], 1.0) for j in later]
            nh = len(hz)
            # h = (1 - R[t,k]) + S[t+1,i] + sum R[t,j]; 1 - F <= h ; h <= nh (1 - F)
            rows.append(([a for a, _ in hz] + [f], [b for _, b in hz] + [1.0], 0.0, inf))  # h - 1 + F >= 0  => sum + F >= 0 (const 1 -1)
            rows.append(([a for a, _ in hz] + [f], [b for _, b in hz] + [nh], -inf, nh - 1.0))
    for k in range(t + 1):
        U[t, k] = var(0.0, budget, False)
    # U[t,0] = sum S[t,i] m_i + R[t,0] m_0
    idx = [U[t, 0], R[t, 0]] + [S[t, i] for i in range(t)]
    val = [1.0, -m[0]] + [-m[i] for i in range(t)]
    rows.append((idx, val, 0.0, 0.0))
    for k in range(t):
        idx = [U[t, k + 1], U[t, k], R[t, k + 1]]; val = [1.0, -1.0, -m[k + 1]]
        for i in deps[k] + [k]:
            idx.append(F[t, i, k]); val.append(m[i])
        rows.append((idx, val, 0.0, 0.0))
    # after the last node of the stage, free too (memory only decreases; no row needed)
print('cols', cols, 'rows', len(rows), flush=True)
lp = highspy.HighsLp(); lp.num_col_ = cols; lp.num_row_ = len(rows)
lp.col_cost_ = np.array(cost); lp.col_lower_ = np.array(lo); lp.col_upper_ = np.array(up)
lp.row_lower_ = np.array([r[2] for r in rows]); lp.row_upper_ = np.array([r[3] for r in rows])
starts = [0]; index = []; value = []
for r in rows: index += r[0]; value += r[1]; starts.append(len(index))
lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
lp.a_matrix_.start_ = np.array(starts); lp.a_matrix_.index_ = np.array(index); lp.a_matrix_.value_ = np.array(value)
lp.integrality_ = [highspy.HighsVarType.kInteger if x else highspy.HighsVarType.kContinuous for x in integ]
h.passModel(lp); h.run()
sol = h.getSolution().col_value; info = h.getInfo()
print('status', h.modelStatusToString(h.getModelStatus()), 'obj', info.objective_function_value, 'bound', info.mip_dual_bound, flush=True)
base = sum(c)
print('overhead', (base + info.objective_function_value) / base)
out = {'n': n, 'budget': budget, 'peak': peak, 'R': [[i for i in range(t + 1) if sol[R[t, i]] > 0.5] for t in range(n)],
       'S': [[i for i in range(t) if sol[S[t, i]] > 0.5] for t in range(n)], 'obj': info.objective_function_value}
json.dump(out, open(sys.argv[4], 'w'))
