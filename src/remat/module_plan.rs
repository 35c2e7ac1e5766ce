//! Choosing modules to checkpoint under a budget (`plan --granularity module`): the
//! cheapest antichain of checkpointable modules (see [`super::modules`]) whose plan
//! fits. Recompute cost is additive over the chosen modules (their recomputed nodes
//! are disjoint); the peak is replayed for every set tried.
//!
//! - **Heuristic** first: greedy (add the module, replacing chosen ones inside it,
//!   with the most peak reduction per added cost; ties by bytes saved at forward end)
//!   until the budget holds; then, from it and from the natural sets (every candidate
//!   root, every leaf, every repeated block), local improvement (drop a chosen
//!   module, or swap one for another, while the plan still fits and gets cheaper).
//! - **Exact** when the candidate tree has at most [`EXACT_ANTICHAINS`] antichains:
//!   every antichain cheaper than the heuristic's plan, in increasing cost; the first
//!   that fits is optimal, and none fitting proves the heuristic's plan optimal (no
//!   plan fits at all: the lowest peak over all of them is the lowest module plans
//!   reach). Cut short by the time limit, the result is not proven.
//!
//! - **Blocks**: the block plan ([`super::blocks`]: per repeated block kept, whole
//!   or, with `selective`, selective, from a dynamic program over the chain) replaces
//!   the search's answer where it is cheaper (or, nothing fitting, lower).
//!
//! Candidates: modules that run as one call, that drop something (checkpointed
//! alone, they lower the peak or the bytes saved at forward end by more than 0.1% of
//! the latter: a BatchNorm alone, which drops only its mean and inverse deviation,
//! is not one),
//! and whose parent has other forward nodes (a wrapper with one child is the same
//! checkpoint). With `selective`, each such module is also a candidate as a
//! selective checkpoint ([`super::modules`]: its convolutions' and matrix products'
//! outputs kept) where that differs and drops something; a module's two variants
//! exclude each other, and the search sees the selective one as nested in the full
//! one. "Optimal" is among plans over the candidates.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::bounds::stage_lower_bound;
use super::graph::RematGraph;
use super::modules::{evaluate, repeated_blocks, Checkpoint, ModulePlan, ModuleTree};

/// The largest number of antichains searched exhaustively (as bit masks: at most 128
/// candidates).
pub const EXACT_ANTICHAINS: usize = 1_000_000;

/// The outcome of a module search.
#[derive(Debug, Clone, Serialize)]
pub struct ModuleSearch {
    /// The best plan found (the cheapest that fits; none fits: the lowest peak).
    pub best: ModulePlan,
    /// Whether `best` fits the budget.
    pub feasible: bool,
    /// Whether no module plan that fits costs less (or, when none fits, no module plan
    /// has a lower peak).
    pub proven_optimal: bool,
    /// Lowest peak over the module plans evaluated (every one when proven).
    pub lowest_peak: u64,
    /// `exhaustive`, `greedy` or `blocks`.
    pub method: &'static str,
    /// Candidate modules.
    pub candidates: usize,
    /// Module sets replayed.
    pub evaluated: usize,
    /// A proven lower bound on the overhead of any plan, op-level ones included
    /// (`bounds::stage_lower_bound`), or this plan's when proven optimal.
    pub lower_bound_overhead: f64,
    /// Modules that cannot be checkpointed as one call (called twice, shared).
    pub excluded: Vec<String>,
    /// Forward nodes outside every module.
    pub unscoped: Vec<String>,
}

struct Space<'a> {
    g: &'a RematGraph,
    t: ModuleTree,
    cks: Vec<Checkpoint>,
    /// Per candidate, the candidates inside it (and itself).
    within: Vec<Vec<bool>>,
    evaluated: usize,
}

impl Space<'_> {
    fn eval(&mut self, set: &[usize]) -> Result<ModulePlan, String> {
        self.evaluated += 1;
        let mut s = set.to_vec();
        s.sort_by_key(|&k| self.t.modules[self.cks[k].module].forward.first().copied());
        let refs: Vec<&Checkpoint> = s.iter().map(|&k| &self.cks[k]).collect();
        evaluate(self.g, &self.t, &refs)
    }
    fn cost(&self, set: &[usize]) -> f64 {
        set.iter().map(|&k| self.cks[k].cost).sum()
    }
    /// `set` with `k` added and every chosen candidate inside `k` removed (the other
    /// variant of `k`'s module too); `None` when `k` lies inside another chosen module.
    fn with(&self, set: &[usize], k: usize) -> Option<Vec<usize>> {
        if set
            .iter()
            .any(|&s| self.within[s][k] && self.cks[s].module != self.cks[k].module)
        {
            return None;
        }
        let mut out: Vec<usize> = set
            .iter()
            .copied()
            .filter(|&s| !self.within[k][s])
            .collect();
        out.push(k);
        Some(out)
    }
}

/// The candidates of a graph: the tree, their checkpoints, and the modules excluded.
fn candidates(
    g: &RematGraph,
    selective: bool,
) -> Result<(ModuleTree, Vec<Checkpoint>, Vec<String>), String> {
    let t = ModuleTree::build(g);
    let base = evaluate(g, &t, &[])?;
    let mut cks = Vec::new();
    for (m, md) in t.modules.iter().enumerate() {
        if !md.contiguous {
            continue;
        }
        if md
            .parent
            .is_some_and(|p| t.modules[p].forward == md.forward)
        {
            continue;
        }
        let full = Checkpoint::new(g, &t, m)?;
        let sel = if selective {
            let s = Checkpoint::selective(g, &t, m)?;
            Some(s).filter(|s| s.recompute != full.recompute)
        } else {
            None
        };
        for c in std::iter::once(full).chain(sel) {
            if c.dropped.is_empty() {
                continue;
            }
            let one = evaluate(g, &t, &[&c])?;
            let saves = base.saved_bytes.saturating_sub(one.saved_bytes);
            let lowers = base.peak_bytes.saturating_sub(one.peak_bytes);
            if saves.max(lowers) > base.saved_bytes / 1000 {
                cks.push(c);
            }
        }
    }
    let excluded = t.excluded();
    Ok((t, cks, excluded))
}

/// Antichains of the candidate forest under `roots` as bit masks (each root: itself,
/// or any antichain of its children's forest; combined across roots); `None` past
/// `cap`.
fn antichains(roots: &[usize], kids: &[Vec<usize>], cap: usize) -> Option<Vec<u128>> {
    let mut acc: Vec<u128> = vec![0];
    for &r in roots {
        let mut opts = antichains(&kids[r], kids, cap)?;
        opts.push(1u128 << r);
        if acc.len().saturating_mul(opts.len()) > cap {
            return None;
        }
        acc = acc
            .iter()
            .flat_map(|a| opts.iter().map(move |o| a | o))
            .collect();
    }
    Some(acc)
}

/// Searches module plans of `g` under `budget` bytes; with `selective`, selective
/// checkpoints are candidates too. Their two variants per module put most trees past
/// exhaustive search, so the search over whole modules runs first (half the time)
/// and its plan seeds the wider one, which never returns a worse plan.
pub fn search(
    g: &RematGraph,
    budget: u64,
    selective: bool,
    time_limit_s: f64,
) -> Result<ModuleSearch, String> {
    let s = search_modules(g, budget, selective, time_limit_s)?;
    // The block plan ([`super::blocks`]): per repeated block, kept, whole or (with
    // `selective`) selective, from a dynamic program over the chain.
    let blocks = super::blocks::plan_blocks_live(g, budget, selective)?;
    Ok(match blocks {
        Some(b) if !s.proven_optimal && beats(&b.plan, &s.best, budget) => ModuleSearch {
            lowest_peak: s.lowest_peak.min(b.plan.peak_bytes),
            feasible: b.fits,
            method: "blocks",
            evaluated: s.evaluated + b.rounds,
            best: b.plan,
            ..s
        },
        _ => s,
    })
}

/// [`search`] over modules alone: whole ones, then (with `selective`) selective ones
/// too, seeded with the first search's answer.
fn search_modules(
    g: &RematGraph,
    budget: u64,
    selective: bool,
    time_limit_s: f64,
) -> Result<ModuleSearch, String> {
    if !selective {
        return search_in(g, budget, false, time_limit_s, &[]);
    }
    let t0 = Instant::now();
    let whole = search_in(g, budget, false, time_limit_s / 2.0, &[])?;
    let left = (time_limit_s - t0.elapsed().as_secs_f64()).max(0.0);
    let wide = search_in(g, budget, true, left, &whole.best.modules)?;
    let better = beats(&wide.best, &whole.best, budget);
    let evaluated = whole.evaluated + wide.evaluated;
    let lowest_peak = whole.lowest_peak.min(wide.lowest_peak);
    Ok(if better || wide.proven_optimal {
        ModuleSearch {
            evaluated,
            lowest_peak,
            ..wide
        }
    } else {
        ModuleSearch {
            candidates: wide.candidates,
            evaluated,
            lowest_peak,
            proven_optimal: false,
            method: "greedy",
            lower_bound_overhead: wide.lower_bound_overhead,
            ..whole
        }
    })
}

/// [`search`] over one candidate set; `seed`: paths of a plan of whole modules to
/// start the local improvement from too.
fn search_in(
    g: &RematGraph,
    budget: u64,
    selective: bool,
    time_limit_s: f64,
    seed: &[String],
) -> Result<ModuleSearch, String> {
    let t0 = Instant::now();
    let limit = Duration::from_secs_f64(time_limit_s.max(0.0));
    let (t, cks, excluded) = candidates(g, selective)?;
    let n = cks.len();
    let within: Vec<Vec<bool>> = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| t.is_within(cks[b].module, cks[a].module))
                .collect()
        })
        .collect();
    let unscoped = t.unscoped_names(g);
    let mut sp = Space {
        g,
        t,
        cks,
        within,
        evaluated: 0,
    };
    let (kids, roots) = forest(&sp);
    let base_cost = g.base_cost().max(f64::MIN_POSITIVE);
    let op_bound = stage_lower_bound(g, budget).unwrap_or(0.0) / base_cost;
    let empty = sp.eval(&[])?;
    let mut lowest = empty.peak_bytes;
    let finish = |sp: &Space, best: ModulePlan, proven: bool, lowest: u64, method| {
        let feasible = best.peak_bytes <= budget;
        let overhead = best.recompute_cost / base_cost;
        ModuleSearch {
            feasible,
            proven_optimal: proven,
            lowest_peak: lowest.min(best.peak_bytes),
            method,
            candidates: n,
            evaluated: sp.evaluated,
            lower_bound_overhead: if proven && feasible {
                overhead.max(op_bound)
            } else {
                op_bound
            },
            excluded: excluded.clone(),
            unscoped: unscoped.clone(),
            best,
        }
    };
    if empty.peak_bytes <= budget {
        return Ok(finish(&sp, empty, true, lowest, "exhaustive"));
    }
    // Greedy.
    let (set, cur) = grow(&mut sp, Vec::new(), empty, budget, &mut lowest, t0, limit)?;
    // Other starting points: the natural module sets (with selective candidates, the
    // roots' selective variants too, and each start that does not fit is grown
    // greedily first); each one that fits is improved.
    let others = other_starts(&sp, &kids, &roots, seed);
    let mut starts = vec![(set, cur)];
    for s in others {
        if s.is_empty() || starts.iter().any(|x| x.0 == s) {
            continue;
        }
        let p = sp.eval(&s)?;
        lowest = lowest.min(p.peak_bytes);
        let (s, p) = if selective {
            grow(&mut sp, s, p, budget, &mut lowest, t0, limit)?
        } else {
            (s, p)
        };
        starts.push((s, p));
    }
    let mut best: Option<ModulePlan> = None;
    for (s, p) in starts {
        let p = if p.peak_bytes <= budget {
            improve(&mut sp, s, p, budget, t0, limit)?
        } else {
            p
        };
        if best.as_ref().is_none_or(|b| beats(&p, b, budget)) {
            best = Some(p);
        }
    }
    let mut best = best.expect("one start at least");
    // Exact where the candidate tree allows: every antichain cheaper than the
    // heuristic's plan, in increasing cost; the first that fits is optimal, and none
    // fitting proves the heuristic's plan optimal.
    let all = if n <= 128 {
        antichains(&roots, &kids, EXACT_ANTICHAINS)
    } else {
        None
    };
    let Some(all) = all else {
        let proven =
            best.peak_bytes <= budget && best.recompute_cost / base_cost <= op_bound + 1e-12;
        return Ok(finish(&sp, best, proven, lowest, "greedy"));
    };
    let fits = best.peak_bytes <= budget;
    let eps = 1e-9 * base_cost;
    let mut keyed: Vec<(f64, u128)> = all
        .into_iter()
        .filter(|&m| m != 0)
        .map(|m| {
            let c = (0..n)
                .filter(|&k| m >> k & 1 == 1)
                .map(|k| sp.cks[k].cost)
                .sum::<f64>();
            (c, m)
        })
        .collect();
    keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut complete = true;
    for (c, m) in keyed {
        if fits && c >= best.recompute_cost - eps {
            break;
        }
        if t0.elapsed() > limit {
            complete = false;
            break;
        }
        let set: Vec<usize> = (0..n).filter(|&k| m >> k & 1 == 1).collect();
        let p = sp.eval(&set)?;
        lowest = lowest.min(p.peak_bytes);
        if p.peak_bytes <= budget {
            return Ok(finish(&sp, p, true, lowest, "exhaustive"));
        }
        if !fits && p.peak_bytes < best.peak_bytes {
            best = p;
        }
    }
    let method = if complete { "exhaustive" } else { "greedy" };
    Ok(finish(&sp, best, complete, lowest, method))
}

/// The candidate forest: each candidate's nearest candidate ancestor, a module's
/// selective variant nested in its full one (so an antichain takes one of them, or
/// modules inside). Returns each candidate's children and the roots.
fn forest(sp: &Space) -> (Vec<Vec<usize>>, Vec<usize>) {
    let n = sp.cks.len();
    let mut kids: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut roots = Vec::new();
    for k in 0..n {
        let same = |a: usize| sp.cks[a].module == sp.cks[k].module;
        let parent = (0..n)
            .filter(|&a| a != k && sp.within[a][k] && !(same(a) && sp.cks[a].selective))
            .max_by_key(|&a| (sp.t.modules[sp.cks[a].module].depth, sp.cks[a].selective));
        match parent {
            Some(p) => kids[p].push(k),
            None => roots.push(k),
        }
    }
    (kids, roots)
}

/// The search's other starting points: the natural module sets (the roots, the
/// leaves of the whole-module forest, the repeated blocks, the seed's modules,
/// and the roots' selective variants), the empty ones left out.
fn other_starts(
    sp: &Space,
    kids: &[Vec<usize>],
    roots: &[usize],
    seed: &[String],
) -> Vec<Vec<usize>> {
    let n = sp.cks.len();
    let blocks: Vec<usize> = repeated_blocks(&sp.t)
        .into_iter()
        .filter_map(|m| sp.cks.iter().position(|c| c.module == m))
        .collect();
    // Leaves of the whole-module forest (a selective variant nests in its module).
    let leaves: Vec<usize> = (0..n)
        .filter(|&k| {
            !sp.cks[k].selective
                && kids[k]
                    .iter()
                    .all(|&c| sp.cks[c].module == sp.cks[k].module && kids[c].is_empty())
        })
        .collect();
    let seeded: Vec<usize> = seed
        .iter()
        .filter_map(|p| {
            sp.cks
                .iter()
                .position(|c| !c.selective && sp.t.modules[c.module].path == *p)
        })
        .collect();
    let seeded = if seeded.len() == seed.len() {
        seeded
    } else {
        Vec::new()
    };
    let sel_roots: Vec<usize> = roots
        .iter()
        .filter_map(|&r| {
            let m = sp.cks[r].module;
            (0..n).find(|&k| sp.cks[k].selective && sp.cks[k].module == m)
        })
        .collect();
    [roots.to_vec(), leaves, blocks, seeded, sel_roots].into()
}

/// Whether plan `p` is better than `b` under `budget`: cheaper when `b` fits (and
/// `p` does), else a lower peak.
fn beats(p: &ModulePlan, b: &ModulePlan, budget: u64) -> bool {
    if b.peak_bytes <= budget {
        p.peak_bytes <= budget && p.recompute_cost < b.recompute_cost
    } else {
        p.peak_bytes < b.peak_bytes
    }
}

/// Greedy growth of `set` until the budget holds: add the candidate (replacing chosen
/// ones inside it, or the other variant of its module) with the most peak reduction
/// per added cost (ties by bytes saved at forward end), until the plan fits, nothing
/// helps, or the time is up.
fn grow(
    sp: &mut Space,
    mut set: Vec<usize>,
    mut cur: ModulePlan,
    budget: u64,
    lowest: &mut u64,
    t0: Instant,
    limit: Duration,
) -> Result<(Vec<usize>, ModulePlan), String> {
    let base_cost = sp.g.base_cost().max(f64::MIN_POSITIVE);
    // Swapping a module's variants can undo a move: never return to a set.
    let key = |s: &[usize]| {
        let mut s = s.to_vec();
        s.sort_unstable();
        s
    };
    let mut seen: std::collections::HashSet<Vec<usize>> = std::collections::HashSet::new();
    seen.insert(key(&set));
    while cur.peak_bytes > budget && t0.elapsed() <= limit {
        let mut pick: Option<(f64, Vec<usize>, ModulePlan)> = None;
        for k in 0..sp.cks.len() {
            let Some(s) = sp.with(&set, k) else { continue };
            if set.contains(&k) || seen.contains(&key(&s)) {
                continue;
            }
            let p = sp.eval(&s)?;
            *lowest = (*lowest).min(p.peak_bytes);
            let dpeak = cur.peak_bytes.saturating_sub(p.peak_bytes) as f64;
            let dsaved = cur.saved_bytes.saturating_sub(p.saved_bytes) as f64;
            if dpeak <= 0.0 && dsaved <= 0.0 {
                continue;
            }
            let dcost = (p.recompute_cost - cur.recompute_cost).max(base_cost * 1e-12);
            let score = (dpeak + 1e-3 * dsaved) / dcost;
            if pick.as_ref().is_none_or(|b| score > b.0) {
                pick = Some((score, s, p));
            }
        }
        let Some((_, s, p)) = pick else { break };
        seen.insert(key(&s));
        set = s;
        cur = p;
    }
    Ok((set, cur))
}

/// Local improvement of a set that fits: drop a module, or swap one for a cheaper
/// one (replacing those inside it), while the plan still fits; until no move helps
/// or the time is up.
fn improve(
    sp: &mut Space,
    mut set: Vec<usize>,
    mut cur: ModulePlan,
    budget: u64,
    t0: Instant,
    limit: Duration,
) -> Result<ModulePlan, String> {
    let n = sp.cks.len();
    let eps = 1e-9 * sp.g.base_cost().max(f64::MIN_POSITIVE);
    let mut improved = true;
    while improved && t0.elapsed() <= limit {
        improved = false;
        'moves: for i in 0..set.len() {
            let rest: Vec<usize> = set.iter().copied().filter(|&x| x != set[i]).collect();
            let p = sp.eval(&rest)?;
            if p.peak_bytes <= budget {
                (set, cur, improved) = (rest, p, true);
                break 'moves;
            }
            for k in 0..n {
                if t0.elapsed() > limit {
                    break 'moves;
                }
                let Some(s) = sp.with(&rest, k) else { continue };
                if sp.cost(&s) >= cur.recompute_cost - eps {
                    continue;
                }
                let p = sp.eval(&s)?;
                if p.peak_bytes <= budget {
                    (set, cur, improved) = (s, p, true);
                    break 'moves;
                }
            }
        }
    }
    Ok(cur)
}

/// What `plan` recomputes (`--granularity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Granularity {
    /// Single ops (the default planners).
    Op,
    /// Whole modules, checkpointed as `torch.utils.checkpoint` does.
    Module,
}

crate::choice::choice!(Granularity {
    Op => "op", "Recompute single ops (the op-level planners)";
    Module => "module", "Checkpoint whole modules as torch.utils.checkpoint does (a plan PyTorch users can apply)";
});

/// Named module plans (`--checkpoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// Every repeated block (`layer1.0`, `transformer.h.3`...), as Hugging Face's
    /// `gradient_checkpointing_enable()`.
    EveryBlock,
    /// Every repeated block under a selective checkpoint whose policy saves the
    /// outputs of matrix products and attention (torchtitan's default op list; and
    /// convolutions) and recomputes the rest ([`super::modules::SELECTIVE_SAVED_OPS`]).
    EveryBlockSelective,
    /// The same, the policy named.
    EveryBlockSelectiveMatmul,
    /// Every repeated block under a selective policy that saves nothing: every-block.
    EveryBlockSelectiveNothing,
    /// Every repeated block offloaded to host memory (saved-tensor hooks): nothing
    /// recomputed.
    EveryBlockOffload,
}

crate::choice::choice!(Preset {
    EveryBlock => "every-block", "Checkpoint every repeated block (layer1.0, transformer.h.3, ...), as Hugging Face's gradient_checkpointing_enable()";
    EveryBlockSelective => "every-block:selective", "Every repeated block under selective activation checkpointing: matrix products' and attention's outputs kept (torchtitan's default policy), the rest recomputed";
    EveryBlockSelectiveMatmul => "every-block:selective=matmul-attention", "The same as every-block:selective, the policy named";
    EveryBlockSelectiveNothing => "every-block:selective=nothing", "Every repeated block under a selective policy that saves nothing: the same as every-block";
    EveryBlockOffload => "every-block:offload", "Every repeated block's saved activations offloaded to host memory after forward and copied back before backward (saved-tensor hooks): nothing recomputed, PCIe traffic instead";
});

impl Preset {
    /// Whether its blocks are checkpointed selectively (their matrix products' and
    /// attention's outputs kept).
    pub fn selective(self) -> bool {
        matches!(
            self,
            Preset::EveryBlockSelective | Preset::EveryBlockSelectiveMatmul
        )
    }

    /// The preset's module plan of `g` (tree `t`).
    pub fn plan_in(self, g: &RematGraph, t: &ModuleTree) -> Result<ModulePlan, String> {
        match self {
            Preset::EveryBlockOffload => super::modules::every_block_offloaded(g, t),
            _ => super::modules::every_block_with(g, t, self.selective()),
        }
    }

    /// Its name in plan reports (`method`).
    pub fn method(self) -> &'static str {
        match self {
            Preset::EveryBlockOffload => "module:every-block:offload",
            p if p.selective() => "module:every-block:selective",
            _ => "module:every-block",
        }
    }
}

/// What the `--pytorch` file says it was made from.
#[derive(Debug, Clone)]
pub struct PytorchHeader {
    /// The model file.
    pub model: String,
    /// The batch (`None`: the model's own).
    pub batch: Option<u64>,
    /// The budget, if one was given.
    pub budget_bytes: Option<u64>,
    /// The plan's predicted peak.
    pub peak_bytes: u64,
    /// How the modules were chosen (`module:greedy`, `every-block`...).
    pub method: String,
}

impl PytorchHeader {
    /// The docstring lines every plan file starts with: model, batch, budget,
    /// predicted peak and method.
    pub fn lines(&self) -> String {
        use crate::units::human_bytes;
        let h = self;
        format!(
            "model: {model}\nbatch: {batch}\nbudget: {budget}\npredicted peak: {peak} ({peak_b} bytes){over}\nmethod: {method}\n",
        model = h.model,
        batch = h.batch.map_or("the model's own".into(), |b| b.to_string()),
        budget = h.budget_bytes.map_or("none given".into(), |b| format!(
            "{} ({b} bytes)",
            human_bytes(b)
        )),
        peak = human_bytes(h.peak_bytes),
        peak_b = h.peak_bytes,
        over = match h.budget_bytes {
            Some(b) if h.peak_bytes > b => ", over the budget: the lowest peak found",
            _ => "",
        },
        method = h.method,
        )
    }
}

/// A self-contained Python module: `CHECKPOINT_MODULES` and `apply(model)`, which
/// wraps each listed module's forward in
/// `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; those also in
/// `selective` (then `SELECTIVE_MODULES`) get a `context_fn` whose policy saves the
/// outputs of convolutions and matrix products (`aten.convolution`, `aten.mm`,
/// `aten.addmm`, `aten.bmm`: [`super::modules::SELECTIVE_SAVED_OPS`]) and recomputes
/// everything else.
pub fn pytorch_module(h: &PytorchHeader, modules: &[String], selective: &[String]) -> String {
    let py_list = |items: &[String]| {
        items
            .iter()
            .map(|m| format!("    {},\n", serde_json::json!(m)))
            .collect::<String>()
    };
    let sel = !selective.is_empty();
    let policy = if sel {
        format!(
            r#"
# Of CHECKPOINT_MODULES, these are checkpointed selectively (PyTorch 2.4 or later):
# the outputs of their convolutions, matrix products and fused attention are kept
# from forward, and only the ops between them run again in backward.
SELECTIVE_MODULES = [
{list}]

_SAVED_OPS = {{
    torch.ops.aten.convolution.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
}} | {{
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
}}


def _policy(ctx, op, *args, **kwargs):
    if op in _SAVED_OPS:
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    if not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        raise RuntimeError("SELECTIVE_MODULES need PyTorch 2.4 or later")
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_policy)
"#,
            list = py_list(selective)
        )
    } else {
        String::new()
    };
    // The pieces only a plan with selective modules has.
    let pick = |x: &'static str| if sel { x } else { "" };
    format!(
        r#""""Activation checkpointing plan made by memplan.

{header}
apply(model) wraps each module below so that its forward runs through
torch.utils.checkpoint.checkpoint(..., use_reentrant=False): the module keeps only
its inputs for backward and runs again when backward reaches it (BatchNorm running
statistics are then updated again, as with any use of torch.utils.checkpoint).
{doc_sel}"""

import functools

{import_torch}import torch.utils.checkpoint

CHECKPOINT_MODULES = [
{list}]
{policy}

def _snapshot(v):
    """Lists, tuples and dicts copied (tensors are not): a container argument as it is
    at call time."""
    if isinstance(v, list):
        return [_snapshot(x) for x in v]
    if type(v) is tuple:
        return tuple(_snapshot(x) for x in v)
    if isinstance(v, dict):
        return {{k: _snapshot(x) for k, x in v.items()}}
    return v


def apply(model):
    """Checkpoints every module of CHECKPOINT_MODULES in `model`; returns `model`."""
    for name in CHECKPOINT_MODULES:
        module = model.get_submodule(name)
        if getattr(module, "_memplan_checkpointed", False):
            continue
        forward = module.forward
{extra}
        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward{extra_param}, **kwargs):
            # The recompute must see the arguments as they are now: DenseNet passes
            # each layer the list of earlier features and appends to it afterwards.
            args = tuple(_snapshot(a) for a in args)
            kwargs = {{k: _snapshot(v) for k, v in kwargs.items()}}
            return torch.utils.checkpoint.checkpoint(
                _forward, *args, use_reentrant=False{extra_kw}, **kwargs
            )

        module.forward = checkpointed
        module._memplan_checkpointed = True
    return model
"#,
        header = h.lines(),
        list = py_list(modules),
        doc_sel = pick(
            "Modules in SELECTIVE_MODULES keep their convolutions' and matrix products' outputs\ntoo, and rerun only the rest.\n"
        ),
        import_torch = pick("import torch\n"),
        extra = pick(
            "        extra = {\"context_fn\": _selective_context} if name in SELECTIVE_MODULES else {}\n"
        ),
        extra_param = pick(", _extra=extra"),
        extra_kw = pick(", **_extra"),
    )
}

/// [`pytorch_module`] with the modules at `offload` (also in `modules`) offloaded to
/// host memory instead of checkpointed: `OFFLOAD_MODULES`, whose forward runs under
/// `torch.autograd.graph.saved_tensors_hooks` that copy every tensor saved for
/// backward to the host (pinned memory on a GPU; on a CPU run a NumPy copy, outside
/// PyTorch's allocator as host memory is beside a device) and back, with its shape,
/// strides and dtype, when backward unpacks it. Parameters, buffers and the module's
/// inputs stay where they are ([`super::modules::Checkpoint::offload`]).
pub fn pytorch_module_with(
    h: &PytorchHeader,
    modules: &[String],
    selective: &[String],
    offload: &[String],
) -> String {
    let checkpointed: Vec<String> = modules
        .iter()
        .filter(|m| !offload.contains(m))
        .cloned()
        .collect();
    let base = pytorch_module(h, &checkpointed, selective);
    if offload.is_empty() {
        return base;
    }
    let list: String = offload
        .iter()
        .map(|m| format!("    {},\n", serde_json::json!(m)))
        .collect();
    let base = base
        .replacen(
            "import functools\n",
            "import functools\nimport weakref\n\nimport torch\n",
            1,
        )
        .replacen("def apply(model):", "def _apply_checkpoints(model):", 1);
    format!(
        r#"{base}

# Offloaded instead of checkpointed: every tensor their forward saves for backward is
# copied to host memory and back when backward needs it; nothing runs again.
OFFLOAD_MODULES = [
{list}]


def _storage(t):
    return t.untyped_storage().data_ptr()


def _tensors(v, out):
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _tensors(x, out)
    elif isinstance(v, dict):
        for x in v.values():
            _tensors(x, out)
    return out


def _offload_hooks(keep):
    # A tensor saved by several ops is copied once (the same tensor, still alive).
    copies = {{}}

    def pack(t):
        if _storage(t) in keep:
            return t
        key = (_storage(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        hit = copies.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            import numpy

            host = numpy.array(flat.numpy(), copy=True)
        else:
            host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(flat)
        packed = (t.shape, t.stride(), t.dtype, t.device, host)
        copies[key] = (weakref.ref(t), packed)
        return packed

    def unpack(p):
        if isinstance(p, torch.Tensor):
            return p
        shape, stride, dtype, device, host = p
        if not isinstance(host, torch.Tensor):
            host = torch.from_numpy(host)
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        out.copy_(host.view(dtype).view(shape))
        return out

    return pack, unpack


def apply(model):
    """Checkpoints CHECKPOINT_MODULES and offloads OFFLOAD_MODULES; returns `model`."""
    _apply_checkpoints(model)
    for name in OFFLOAD_MODULES:
        module = model.get_submodule(name)
        if getattr(module, "_memplan_offloaded", False):
            continue
        forward = module.forward
        owned = {{_storage(p) for p in module.parameters()}}
        owned |= {{_storage(b) for b in module.buffers()}}

        @functools.wraps(forward)
        def offloaded(*args, _forward=forward, _owned=owned, **kwargs):
            keep = _owned | {{_storage(t) for t in _tensors((args, kwargs), [])}}
            with torch.autograd.graph.saved_tensors_hooks(*_offload_hooks(keep)):
                return _forward(*args, **kwargs)

        module.forward = offloaded
        module._memplan_offloaded = True
    return model
"#
    )
}

/// A module plan as `plan` reports it.
#[derive(Debug, Clone)]
pub struct ModuleOutcome {
    /// The plan's report (`method`: `module:exhaustive`, `module:greedy` or
    /// `module:every-block`; `solver` is the one asked for, unused here).
    pub report: super::plan::PlanReport,
    /// Checkpointed modules, in execution order (selective ones included).
    pub modules: Vec<String>,
    /// Those of them checkpointed selectively.
    pub selective: Vec<String>,
    /// Those of them offloaded to host memory, and the host and PCIe bytes.
    pub offloaded: Vec<String>,
    /// Host memory the offloaded activations take.
    pub host_bytes: u64,
    /// PCIe bytes per step (to the host and back).
    pub pcie_bytes: u64,
    /// Bytes saved at forward end ([`super::modules::saved_at_forward_end`]).
    pub saved_bytes: u64,
    /// Whether proven optimal among module plans (`None` for a preset).
    pub proven_optimal: Option<bool>,
    /// Forward nodes outside every module.
    pub unscoped: Vec<String>,
    /// Modules that cannot be checkpointed as one call.
    pub excluded: Vec<String>,
    /// Search only: candidate modules, and module sets replayed.
    pub searched: Option<(usize, usize)>,
}

/// Which modules a module plan checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chosen {
    /// The cheapest set found by [`search`] under the budget; `selective`: selective
    /// checkpoints are candidates too.
    Search {
        /// Whether selective checkpoints are candidates.
        selective: bool,
    },
    /// A named preset.
    Preset(Preset),
    /// These module paths ([`super::modules::module_plan_in`]): checkpointed whole,
    /// and checkpointed selectively.
    Modules {
        /// Checkpointed whole.
        full: Vec<String>,
        /// Checkpointed selectively.
        selective: Vec<String>,
        /// Offloaded to host memory.
        offload: Vec<String>,
    },
}

/// Plans `g` at module granularity: the search under `budget` (required), a preset, or
/// the modules given. The budget, when given, decides `feasible`.
pub fn plan_modules(
    g: &RematGraph,
    chosen: &Chosen,
    budget: Option<u64>,
    solver: super::plan::Solver,
    time_limit_s: f64,
) -> crate::error::Result<ModuleOutcome> {
    use crate::error::Error;
    let t0 = Instant::now();
    let base = g.baseline_peak().map_err(Error::Graph)?;
    let base_cost = g.base_cost().max(f64::MIN_POSITIVE);
    let mut searched = None;
    let (best, lowest, lb, proven, method, unscoped, excluded) = match (chosen, budget) {
        (Chosen::Preset(_) | Chosen::Modules { .. }, _) => {
            let t = ModuleTree::build(g);
            let (p, method) = match chosen {
                Chosen::Modules {
                    full,
                    selective,
                    offload,
                } => {
                    fn refs(v: &[String]) -> Vec<&str> {
                        v.iter().map(|x| x.as_str()).collect()
                    }
                    (
                        super::modules::module_plan_with(
                            g,
                            &t,
                            &refs(full),
                            &refs(selective),
                            &refs(offload),
                        )
                        .map_err(Error::Graph)?,
                        "module:given",
                    )
                }
                Chosen::Preset(p) => (p.plan_in(g, &t).map_err(Error::Graph)?, p.method()),
                Chosen::Search { .. } => {
                    return Err(Error::Graph("a module search has no preset".into()))
                }
            };
            // The recompute bound does not hold for a plan that offloads instead.
            let lb = match p.offloaded.is_empty() {
                true => {
                    stage_lower_bound(g, budget.unwrap_or(p.peak_bytes)).unwrap_or(0.0) / base_cost
                }
                false => 0.0,
            };
            let low = p.peak_bytes;
            (
                p,
                low,
                lb,
                None,
                method.to_string(),
                t.unscoped_names(g),
                t.excluded(),
            )
        }
        (Chosen::Search { selective }, Some(b)) => {
            let s = search(g, b, *selective, time_limit_s).map_err(Error::Graph)?;
            searched = Some((s.candidates, s.evaluated));
            (
                s.best,
                s.lowest_peak,
                s.lower_bound_overhead,
                Some(s.proven_optimal),
                format!("module:{}", s.method),
                s.unscoped,
                s.excluded,
            )
        }
        (Chosen::Search { .. }, None) => {
            return Err(Error::Graph("a module search needs a budget".into()))
        }
    };
    let recomputed = super::plan::recomputed_values(g, &best.plan);
    let budget_bytes = budget.unwrap_or(best.peak_bytes);
    let report = super::plan::PlanReport {
        solver,
        feasible: best.peak_bytes <= budget_bytes,
        budget_bytes,
        peak_bytes: best.peak_bytes,
        baseline_peak_bytes: base,
        min_feasible_bytes: lowest.min(best.peak_bytes),
        op_local_bound_bytes: g.op_local_bound().max(super::bounds::memory_floor(g)),
        proven_floor_bytes: 0,
        recompute_flops: best.recompute_cost,
        baseline_flops: g.base_cost(),
        overhead: best.recompute_cost / base_cost,
        lower_bound_overhead: lb,
        solve_seconds: t0.elapsed().as_secs_f64(),
        recomputed,
        schedule_len: best.plan.len(),
        method,
        plan: best.plan.clone(),
    };
    Ok(ModuleOutcome {
        report,
        modules: best.modules.clone(),
        selective: best.selective.clone(),
        offloaded: best.offloaded.clone(),
        host_bytes: best.host_bytes,
        pcie_bytes: best.pcie_bytes,
        saved_bytes: best.saved_bytes,
        proven_optimal: proven,
        unscoped,
        excluded,
        searched,
    })
}
