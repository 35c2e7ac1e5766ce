//! `memplan plan`.

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::{choice, parse_budget, parse_dims, DeviceArgs, FsdpArgs, TrainArgs};
use memplan::infer::Bindings;
use memplan::memory::device::StepValues;
use memplan::remat::dag::load_dag;
use memplan::remat::graph::replay_on_device;
use memplan::remat::module_plan::{
    plan_modules, pytorch_module_with, Chosen, Granularity as By, Preset, PytorchHeader,
};
use memplan::remat::modules::saved_at_forward_end;
use memplan::remat::plan::{plan, recomputed_modules, Solver};
use memplan::report::plan::{plan_json, plan_text, Granularity, PlanDevice};
use memplan::step::load_on;
use memplan::units::human_bytes;

/// `plan`'s flags.
#[derive(clap::Args)]
pub struct PlanArgs {
    /// The ONNX file (or use --dag).
    #[arg(required_unless_present = "dag")]
    model: Option<PathBuf>,
    /// A rematerialization benchmark graph (node-link JSON) instead of a model.
    #[arg(long, conflicts_with = "model")]
    dag: Option<PathBuf>,
    /// Batch size (ONNX models).
    #[arg(long)]
    batch: Option<u64>,
    /// Binds another named dimension (repeatable).
    #[arg(long = "dim", value_name = "NAME=VALUE")]
    dims: Vec<String>,
    /// Mixture-of-experts models: how many tokens each expert receives, which the
    /// data decides: `balanced` (the default: T·k/E each), `capacity=F` (each at F
    /// times that, at most every token) or `worst` (one expert takes every token).
    /// Stated in the output.
    #[arg(long, value_name = "ROUTING", value_parser = super::routing_arg)]
    moe_routing: Option<memplan::moe::Routing>,
    /// Budget: a size (`8GiB`), a percentage of the no-recompute peak (`50%`) or,
    /// below 1, a fraction of it (`0.5`).
    /// With --pareto: the lowest budget of the sweep (optional).
    #[arg(long, required_unless_present_any = ["pareto", "checkpoint", "checkpoint_modules", "selective_modules", "offload_modules"])]
    budget: Option<String>,
    /// Planner.
    #[arg(long, value_parser = choice::<Solver>(), default_value = "ilp")]
    solver: Solver,
    /// Solver time limit in seconds (MILP solvers) [default: 60; 8 on graphs above
    /// 4000 nodes, an LLM's step, where the block plan is in the portfolio]
    #[arg(long, value_parser = super::time_limit_arg)]
    time_limit: Option<f64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Write the whole plan (versioned JSON, docs/PLAN_FORMAT.md) to this file.
    #[arg(short = 'o', long = "output")]
    output: Option<PathBuf>,
    /// Write the planned training step as ONNX (recomputations inserted, backward
    /// ops in domain ai.memplan; docs/PLAN_FORMAT.md). ONNX models only.
    #[arg(long, value_name = "OUT.onnx", conflicts_with = "dag")]
    rewrite: Option<PathBuf>,
    /// Measured costs: a JSON object mapping every node name to seconds, replacing
    /// FLOPs (recompute_flops and baseline_flops are then seconds; docs/PLAN_FORMAT.md).
    #[arg(long, value_name = "FILE")]
    costs: Option<PathBuf>,
    /// Model each node's cost as the longer of its FLOPs at FLOPS per second and of
    /// the bytes it reads and writes at BYTES per second (e.g. 94G,17G), instead of
    /// FLOPs: the cost of rerunning an op in eager PyTorch, where every rerun is its
    /// own pass over memory. Costs are then seconds (cost_unit "roofline").
    #[arg(long, value_name = "FLOPS,BYTES", conflicts_with_all = ["costs", "dag"])]
    roofline: Option<memplan::remat::costs::Roofline>,
    /// Sweep budgets from the no-recompute peak down to the lowest reachable one (or
    /// to --budget) and print the curve: budget, peak, overhead, lower bound, feasible.
    #[arg(long, conflicts_with_all = ["output", "rewrite"])]
    pareto: bool,
    /// What to recompute: single ops, or whole modules checkpointed as
    /// `torch.utils.checkpoint` does (named from the exporter's scopes).
    #[arg(long, value_parser = choice::<By>(), default_value = "op")]
    granularity: By,
    /// A named module plan instead of a search (no budget needed).
    #[arg(long, value_parser = choice::<Preset>(), conflicts_with_all = ["pareto", "dag"])]
    checkpoint: Option<Preset>,
    /// Checkpoint exactly these modules (comma-separated paths, e.g.
    /// `layer1.0,layer2.0`) instead of a search; no budget needed.
    #[arg(long, value_name = "PATHS", conflicts_with_all = ["pareto", "dag", "checkpoint"])]
    checkpoint_modules: Option<String>,
    /// Module search: a module may also be checkpointed selectively (PyTorch's
    /// create_selective_checkpoint_contexts): its convolutions' and matrix products'
    /// outputs are kept, and only the ops between them run again. The search over whole
    /// modules then gets half of --time-limit and seeds the wider one.
    #[arg(long, conflicts_with_all = ["pareto", "dag", "checkpoint", "checkpoint_modules", "selective_modules", "offload_modules"])]
    selective: bool,
    /// Checkpoint these modules selectively (comma-separated paths), beside
    /// --checkpoint-modules, instead of a search; no budget needed.
    #[arg(long, value_name = "PATHS", conflicts_with_all = ["pareto", "dag", "checkpoint"])]
    selective_modules: Option<String>,
    /// Offload these modules' saved activations to host memory (comma-separated
    /// paths), beside --checkpoint-modules: copied to the host when saved, back before
    /// each backward use (the --pytorch file's saved-tensor hooks); nothing recomputed,
    /// no budget needed.
    #[arg(long, value_name = "PATHS", conflicts_with_all = ["pareto", "dag", "checkpoint", "selective"])]
    offload_modules: Option<String>,
    /// Write the plan as a Python module with apply(model). A module plan:
    /// CHECKPOINT_MODULES, wrapped in torch.utils.checkpoint. An op plan: RECOMPUTE,
    /// the values dropped after forward and recomputed in backward (saved-tensor hooks).
    #[arg(long, value_name = "FILE.py", conflicts_with = "pareto")]
    pytorch: Option<PathBuf>,
    #[command(flatten)]
    training: TrainArgs,
    #[command(flatten)]
    device: DeviceArgs,
    #[command(flatten)]
    fsdp: FsdpArgs,
}

/// Runs `plan`.
#[allow(clippy::too_many_lines)] // Long by design: the command's options, checked and applied in turn.
pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let PlanArgs {
        model,
        moe_routing,
        dag,
        batch,
        dims,
        budget,
        solver,
        time_limit,
        json,
        output,
        rewrite,
        costs,
        roofline,
        pareto,
        granularity,
        checkpoint,
        checkpoint_modules,
        selective,
        selective_modules,
        offload_modules,
        pytorch,
        training,
        device,
        fsdp,
    } = a;
    if fsdp.fsdp.is_some() && (rewrite.is_some() || pytorch.is_some() || dag.is_some()) {
        bail!("--fsdp plans one rank's step of an ONNX model; --rewrite, --pytorch and --dag write or read the unsharded model's: plan without --fsdp for them");
    }
    super::refuse_overwriting_inputs(
        &[
            ("--output", output.as_deref()),
            ("--rewrite", rewrite.as_deref()),
            ("--pytorch", pytorch.as_deref()),
        ],
        &[model.as_deref(), dag.as_deref(), costs.as_deref()],
    )?;
    if device.given() && dag.is_some() {
        bail!("--allocator, --alloc-conf, --gpu and --cuda-context describe a model's training step, not --dag");
    }
    let paths = |list: &Option<String>| -> Vec<String> {
        list.iter()
            .flat_map(|l| l.split(','))
            .map(|x| x.trim().to_string())
            .filter(|x| !x.is_empty())
            .collect()
    };
    let chosen = match checkpoint {
        Some(p) => Chosen::Preset(p),
        None if checkpoint_modules.is_some()
            || selective_modules.is_some()
            || offload_modules.is_some() =>
        {
            Chosen::Modules {
                full: paths(&checkpoint_modules),
                selective: paths(&selective_modules),
                offload: paths(&offload_modules),
            }
        }
        None => Chosen::Search { selective },
    };
    let opts = training.options()?;
    let by_module = granularity == By::Module || !matches!(chosen, Chosen::Search { .. });
    if selective && !by_module {
        bail!("--selective chooses module plans: give --granularity module");
    }
    if pytorch.is_some() && dag.is_some() {
        bail!("--pytorch writes a plan for a PyTorch model: it needs an ONNX model, not --dag");
    }
    if pareto && by_module {
        bail!("--pareto sweeps op plans: it does not take --granularity module");
    }
    use memplan::remat::costs::{apply_costs, apply_roofline, load_costs, CostUnit};
    use memplan::remat::pareto::{pareto as sweep, DEFAULT_POINTS};
    let unit = match (&costs, &dag, &roofline) {
        (Some(_), _, _) => CostUnit::Seconds,
        (None, Some(_), _) => CostUnit::Benchmark,
        (None, None, Some(_)) => CostUnit::Roofline,
        (None, None, None) => CostUnit::Flops,
    };
    if rewrite.is_some() && dag.is_some() {
        bail!("--rewrite writes ONNX: it needs an ONNX model, not --dag");
    }
    let model_path = model.clone();
    // Optimizer state per value (allocated at its first use on the device).
    let mut values = None;
    let (g, path) = match (model, dag) {
        (_, Some(d)) => {
            let path = d.display().to_string();
            (load_dag(&d).with_context(|| path.clone())?, path)
        }
        (Some(m), None) => {
            let path = m.display().to_string();
            let b = Bindings {
                batch,
                dims: parse_dims(&dims)?,
                routing: moe_routing,
            };
            let (model, step) =
                load_on(&m, &b, &opts, fsdp.settings().as_ref()).with_context(|| path.clone())?;
            super::warn_inference_export(&path, &model);
            values = Some(StepValues::of(&step.schedule));
            (step.graph, path)
        }
        (None, None) => bail!("give a MODEL or --dag FILE"),
    };
    let mut g = g;
    if let Some(c) = &costs {
        let at = || c.display().to_string();
        apply_costs(&mut g, &load_costs(c).with_context(at)?).with_context(at)?;
    }
    if let Some(r) = roofline {
        apply_roofline(&mut g, r);
    }
    use memplan::remat::portfolio::{LARGE_NODES, LARGE_TIME_LIMIT_S};
    let time_limit = time_limit.unwrap_or(if g.nodes.len() > LARGE_NODES {
        LARGE_TIME_LIMIT_S
    } else {
        60.0
    });
    let baseline = g
        .baseline_peak()
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    let budget_bytes = budget
        .as_deref()
        .map(|b| parse_budget(b, baseline))
        .transpose()?;
    if pareto {
        let curve = sweep(&g, solver, time_limit, DEFAULT_POINTS, budget_bytes)
            .with_context(|| path.clone())?;
        if json {
            let mut v = serde_json::to_value(&curve.points)?;
            for p in v.as_array_mut().into_iter().flatten() {
                p["cost_unit"] = serde_json::json!(unit);
            }
            super::out(&(serde_json::to_string_pretty(&v)? + "\n"))?;
        } else {
            super::out(&format!(
                "graph        {path} ({} nodes, {} values)\n",
                g.nodes.len(),
                g.values.len()
            ))?;
            super::out(&curve.to_text(unit))?;
        }
        return Ok(());
    }
    let (r, gran) = if by_module {
        let o = plan_modules(&g, &chosen, budget_bytes, solver, time_limit)
            .with_context(|| path.clone())?;
        if let Some(py) = &pytorch {
            let h = PytorchHeader {
                model: path.clone(),
                batch,
                budget_bytes,
                peak_bytes: o.report.peak_bytes,
                method: o.report.method.clone(),
            };
            memplan::files::write_atomic(
                py,
                pytorch_module_with(&h, &o.modules, &o.selective, &o.offloaded).as_bytes(),
            )?;
        }
        let gran = Granularity {
            granularity: "module".into(),
            checkpoint_modules: o.modules,
            selective_modules: o.selective,
            host_bytes: (!o.offloaded.is_empty()).then_some(o.host_bytes),
            pcie_bytes: (!o.offloaded.is_empty()).then_some(o.pcie_bytes),
            pcie_seconds: device
                .gpu
                .filter(|_| !o.offloaded.is_empty())
                .map(|c| o.pcie_bytes as f64 / c.pcie_bytes_per_s()),
            offloaded_modules: o.offloaded,
            saved_bytes_at_forward_end: o.saved_bytes,
            proven_optimal: o.proven_optimal,
            module_candidates: o.searched.map(|x| x.0),
            module_sets_evaluated: o.searched.map(|x| x.1),
            unscoped_nodes: o.unscoped,
            excluded_modules: o.excluded,
        };
        (o.report, gran)
    } else {
        let budget_bytes = budget_bytes.context("--budget is required without --pareto")?;
        // A PyTorch file reruns only some ops: the plan for it recomputes no other.
        let for_pytorch = pytorch.as_ref().map(|_| {
            let mut h = g.clone();
            let kept = memplan::remat::pytorch_ops::keep_what_pytorch_cannot_rerun(&mut h);
            (h, kept)
        });
        if let Some((_, kept)) = for_pytorch.as_ref().filter(|(_, k)| !k.is_empty()) {
            let n: usize = kept.iter().map(|k| k.1).sum();
            let ops: Vec<String> = kept
                .iter()
                .take(6)
                .map(|(o, c)| format!("{o} {c}"))
                .collect();
            let more = if kept.len() > 6 { ", ..." } else { "" };
            eprintln!(
                "note: {n} forward ops the --pytorch file cannot rerun in PyTorch are kept, not recomputed ({}{more})",
                ops.join(", ")
            );
        }
        let planned_on = for_pytorch.as_ref().map_or(&g, |(h, _)| h);
        let r = plan(planned_on, budget_bytes, solver, time_limit).with_context(|| path.clone())?;
        if let Some(py) = &pytorch {
            use memplan::remat::pytorch_ops::{pytorch_op_module, reruns};
            let h = PytorchHeader {
                model: path.clone(),
                batch,
                budget_bytes: Some(budget_bytes),
                peak_bytes: r.peak_bytes,
                method: r.method.clone(),
            };
            let rr = reruns(&g, &r.plan);
            memplan::files::write_atomic(py, pytorch_op_module(&h, &rr).as_bytes())?;
            if let Some(note) = memplan::remat::pytorch_ops::unreachable_note(&rr) {
                eprintln!("note: {}: {note}", py.display());
            }
            if !rr.is_empty() {
                eprintln!(
                    "note: {}: PyTorch recomputes each value when backward first needs it and keeps it until its last use, so its step peak can exceed this plan's (measured: up to +41 %, docs/TRAINING_MEMORY.md); what it keeps after forward is this plan's",
                    py.display()
                );
            }
        }
        let gran = Granularity {
            granularity: "op".into(),
            saved_bytes_at_forward_end: saved_at_forward_end(&g, &r.plan),
            ..Default::default()
        };
        (r, gran)
    };
    let modules = recomputed_modules(&g, &r.plan);
    if let Some(out) = output {
        use memplan::remat::planfile::{PlanFile, StepSource, FORMAT, VERSION};
        let step = match &model_path {
            Some(m) => Some(StepSource::new(m, batch, &parse_dims(&dims)?, &opts)),
            None => None,
        };
        let doc = PlanFile {
            format: FORMAT.into(),
            version: VERSION,
            graph: g.clone(),
            budget_bytes: r.budget_bytes,
            predicted_peak_bytes: r.peak_bytes,
            solver: serde_json::json!(r.solver)
                .as_str()
                .unwrap_or_default()
                .to_string(),
            cost_unit: serde_json::json!(unit)
                .as_str()
                .unwrap_or_default()
                .to_string(),
            plan: r.plan.clone(),
            step,
            feasible: Some(r.feasible),
        };
        memplan::files::write_atomic(&out, &doc.to_json())?;
    }
    if let (Some(out), Some(m)) = (&rewrite, &model_path) {
        let bindings = Bindings {
            batch,
            dims: parse_dims(&dims)?,
            routing: moe_routing,
        };
        memplan::rewrite::write_rewrite(m, &bindings, &opts, &g, &r, out)
            .with_context(|| format!("--rewrite {}", out.display()))?;
    }
    // The planned step and the baseline through the caching allocator (models only).
    let on_device = match &values {
        Some(values) if r.feasible => {
            let d = device.model()?.on_groups(&fsdp.groups());
            let unlimited = |p: &[_]| {
                replay_on_device(&g, p, values, &d).map_err(|e| super::replay_failed(&path, e))
            };
            let planned = unlimited(&r.plan)?;
            let baseline = unlimited(&g.no_recompute_plan())?;
            Some(PlanDevice::new(&d, planned, baseline))
        }
        _ => None,
    };
    if json {
        let mut v = plan_json(&r, &path, &modules, unit, &gran)?;
        if let Some(dv) = &on_device {
            if let serde_json::Value::Object(extra) = serde_json::to_value(dv)? {
                for (k, x) in extra {
                    v[k] = x;
                }
            }
        }
        super::out(&(serde_json::to_string_pretty(&v)? + "\n"))?;
    } else {
        super::out(&plan_text(&r, &g, &path, &modules, unit, &gran))?;
        if let Some(dv) = &on_device {
            super::out(&dv.to_text())?;
        }
    }
    // A budget that cannot be met is a failure for a script that asked for it; the
    // report above (the lowest-peak plan) is still printed and written. `--solver
    // none` and `sqrt` ask for one schedule, whatever the budget.
    let searched = !matches!(solver, Solver::None | Solver::Sqrt);
    if let (false, Some(b), true) = (r.feasible, budget_bytes, searched) {
        if !matches!(chosen, Chosen::Search { .. }) {
            bail!(
                "{path}: the chosen modules peak at {}, over the budget of {}",
                human_bytes(r.peak_bytes),
                human_bytes(b)
            );
        }
        let proven = if r.proven_floor_bytes > b {
            format!(
                " (proven: no schedule peaks below {})",
                human_bytes(r.proven_floor_bytes)
            )
        } else {
            String::new()
        };
        bail!(
            "{path}: no plan fits the budget of {}: the lowest peak found is {} (no recompute: {}){proven}",
            human_bytes(b),
            human_bytes(r.min_feasible_bytes),
            human_bytes(r.baseline_peak_bytes)
        );
    }
    Ok(())
}
