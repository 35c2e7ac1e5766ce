//! `fit`'s text rendering (its JSON is `FitReport` itself).

use crate::fit::time::human_seconds;
use crate::fit::{FitReport, Recommendation};
use crate::units::human_bytes;

/// `fit`'s table. `to_try`, where the report names fragmentation, is a line
/// printed right under it (the command's way to try expandable segments).
pub fn fit_text(r: &FitReport, to_try: Option<&str>) -> String {
    let mut s = format!(
        "model        {}\nbudget       {} per GPU ({} optimizer, {}, {} GPU{})\nbatch 1 needs {} as exported\n\n",
        r.model,
        human_bytes(r.memory_bytes),
        r.optimizer,
        r.precision,
        r.gpus,
        if r.gpus == 1 { "" } else { "s" },
        human_bytes(r.batch1_bytes)
    );
    if let Some(m) = &r.moe_routing {
        s.push_str(&format!(
            "experts      MoE routing assumed {}: {} experts, top-{}\n\n",
            m.assumption, m.experts, m.top_k
        ));
    }
    if let Some(d) = &r.device {
        s.push_str(&format!(
            "device       {}: CUDA context {}, headroom {}, so PyTorch's caching allocator may reserve {}{}
             a batch fits when the step's allocations, replayed through the allocator, fit there

",
            d.gpu.as_deref().unwrap_or("generic GPU"),
            human_bytes(d.context_bytes),
            human_bytes(d.headroom_bytes.unwrap_or(0)),
            human_bytes(d.allocator_capacity_bytes.unwrap_or(0)),
            if d.expandable_segments { " (expandable segments)" } else { "" }
        ));
    }
    let w = r
        .strategies
        .iter()
        .map(|st| st.name.len())
        .max()
        .unwrap_or(0)
        .max(22);
    let smi = r.device.is_some();
    s.push_str(&format!(
        "  {:<w$} {:>9} {:>12}{} {:>9}  notes\n",
        "strategy",
        "max batch",
        "peak",
        if smi { "   nvidia-smi" } else { "" },
        "overhead"
    ));
    for st in &r.strategies {
        let batch = match (st.max_batch, st.global_batch) {
            (0, _) => "none".to_string(),
            (b, Some(gb)) if gb != b => format!("{b} ({gb})"),
            (b, _) => b.to_string(),
        };
        let mut note = st.note.clone();
        if let Some(c) = st.communication_bytes {
            note.push_str(&format!("; communication {}/step", human_bytes(c)));
        }
        if let (Some(p), Some(h)) = (st.pcie_bytes, st.host_bytes) {
            note.push_str(&format!(
                "; PCIe {}/step, host {}",
                human_bytes(p),
                human_bytes(h)
            ));
        }
        if let Some(t) = st.step_seconds {
            note.push_str(&format!("; step ~{}", human_seconds(t)));
        }
        if let Some(same) = &st.same_as {
            note.push_str(&format!("; same figures: {}", same.join(", ")));
        }
        let shown = match (smi, st.device_bytes) {
            (false, _) => String::new(),
            (true, Some(b)) => format!(" {:>12}", human_bytes(b)),
            (true, None) => format!(" {:>12}", "-"),
        };
        s.push_str(&format!(
            "  {:<w$} {:>9} {:>12}{shown} {:>8.1}%  {}\n",
            st.name,
            batch,
            human_bytes(st.peak_bytes),
            st.overhead * 100.0,
            note
        ));
    }
    if let (Some(t), Some(rec)) = (r.target_batch, &r.recommendation) {
        s.push_str(&format!(
            "\nrecommended for global batch {t}: {}\n  {}; peak {} per GPU; extra compute {:.1}%; communication {}/step; PCIe {}/step; host {}\n  {}\n",
            rec.strategies.join(" + "),
            split_phrase(rec, r.gpus),
            human_bytes(rec.peak_bytes),
            rec.overhead * 100.0,
            human_bytes(rec.communication_bytes),
            human_bytes(rec.pcie_bytes),
            human_bytes(rec.host_bytes),
            rec.why
        ));
        if let Some(t) = &rec.step_time {
            s.push_str(&format!(
                "  estimated step {}: compute {}, recompute {}, exposed communication {} (of {}{}), PCIe {}\n",
                human_seconds(t.total_s),
                human_seconds(t.compute_s),
                human_seconds(t.recompute_s),
                human_seconds(t.exposed_communication_s),
                human_seconds(t.communication_s),
                rec.interconnect
                    .as_ref()
                    .map(|l| format!(
                        " over {} at {:.0} GB/s",
                        l.name,
                        l.bytes_per_s / 1e9
                    ))
                    .unwrap_or_default(),
                human_seconds(t.pcie_s)
            ));
            s.push_str("  (rooflines at the card's peak rates: a lower bound, used to rank)\n");
        }
    }
    if smi {
        s.push_str("\npeak: live tensor bytes at the step's peak; nvidia-smi: what it would show for the process at max batch (reserved by the allocator + CUDA context)\n");
    }
    if let Some(f) = &r.fragmentation {
        s.push_str(&format!(
            "fragmentation: at batch {}, {} reserves {} more than its live tensors ({:.0}% of what the allocator may reserve); PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) give most of that back\n",
            f.max_batch,
            f.strategy,
            human_bytes(f.excess_bytes),
            f.fraction_of_capacity * 100.0
        ));
        if let Some(t) = to_try {
            s.push_str(&format!("  ({t})\n"));
        }
    }
    if let Some(u) = &r.unreachable {
        s.push_str(&format!("\n{u}\n"));
    }
    s
}

/// How a recommendation splits the global batch: "micro-batch 64 × 8 steps × 1 GPU =
/// 512" (the text and the HTML report say it alike).
pub(crate) fn split_phrase(rec: &Recommendation, gpus: u64) -> String {
    format!(
        "micro-batch {} × {} step{} × {} GPU{} = {}",
        rec.micro_batch,
        rec.accumulation_steps,
        if rec.accumulation_steps == 1 { "" } else { "s" },
        gpus,
        if gpus == 1 { "" } else { "s" },
        rec.global_batch
    )
}
