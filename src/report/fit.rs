//! `fit`'s text rendering (its JSON is `FitReport` itself).

use crate::fit::FitReport;
use crate::units::human_bytes;

/// `fit`'s table.
pub fn fit_text(r: &FitReport) -> String {
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
    s.push_str(&format!(
        "  {:<22} {:>9} {:>12} {:>9}  notes\n",
        "strategy", "max batch", "peak", "overhead"
    ));
    for st in &r.strategies {
        let batch = match (st.max_batch, st.global_batch) {
            (0, _) => "none".to_string(),
            (b, Some(gb)) if gb != b => format!("{b} ({gb})"),
            (b, _) => b.to_string(),
        };
        s.push_str(&format!(
            "  {:<22} {:>9} {:>12} {:>8.1}%  {}\n",
            st.name,
            batch,
            human_bytes(st.peak_bytes),
            st.overhead * 100.0,
            st.note
        ));
    }
    s
}
