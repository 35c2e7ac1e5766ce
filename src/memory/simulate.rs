//! Replays a training [`Schedule`]: when each storage is allocated and freed, bytes by
//! category after every step, and the peak.
//!
//! A storage is allocated by the step that writes it and freed after the last step
//! that reads or updates it before it is written again (a recomputed tensor is a new
//! allocation). Persistent storages (parameters, buffers, optimizer state, the input
//! batch) are live throughout; held ones (model outputs, the loss, parameter
//! gradients) stay until the end of the step once made. Everything a step reads and
//! writes is live during it.

use serde::Serialize;

use crate::train::{Schedule, Storage, StorageKind};

/// Memory categories reported for training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Trainable parameters.
    Parameters,
    /// Non-trainable floating initializers and constants.
    Buffers,
    /// Parameter gradients.
    Gradients,
    /// Optimizer state.
    Optimizer,
    /// Tensors backward reads (from the step they are made until their last use).
    SavedActivations,
    /// Everything else: activations no backward reads, activation gradients, casts,
    /// partial gradients, optimizer temporaries, the loss.
    Temporaries,
}

/// All categories, in report order.
pub const CATEGORIES: [Category; 6] = [
    Category::Parameters,
    Category::Buffers,
    Category::Gradients,
    Category::Optimizer,
    Category::SavedActivations,
    Category::Temporaries,
];

impl Category {
    /// Its key in a [`Breakdown`] (JSON).
    pub fn key(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Buffers => "buffers",
            Category::Gradients => "gradients",
            Category::Optimizer => "optimizer",
            Category::SavedActivations => "saved_activations",
            Category::Temporaries => "temporaries",
        }
    }

    /// How reports name it.
    pub fn label(self) -> &'static str {
        match self {
            Category::Optimizer => "optimizer state",
            Category::SavedActivations => "saved activations",
            c => c.key(),
        }
    }
}

/// The category a storage counts under.
pub fn category(s: &Storage) -> Category {
    match s.kind {
        StorageKind::Parameter => Category::Parameters,
        StorageKind::Buffer | StorageKind::Constant => Category::Buffers,
        StorageKind::ParamGrad => Category::Gradients,
        StorageKind::OptimizerState => Category::Optimizer,
        _ if s.saved => Category::SavedActivations,
        _ => Category::Temporaries,
    }
}

/// Bytes by category at one point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    /// Trainable parameters.
    pub parameters: u64,
    /// Buffers and constants.
    pub buffers: u64,
    /// Parameter gradients.
    pub gradients: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Saved activations.
    pub saved_activations: u64,
    /// Temporaries.
    pub temporaries: u64,
}

impl Breakdown {
    /// Sum of all categories.
    pub fn total(&self) -> u64 {
        self.parameters
            + self.buffers
            + self.gradients
            + self.optimizer
            + self.saved_activations
            + self.temporaries
    }

    /// The bytes of one category.
    pub fn get(&self, c: Category) -> u64 {
        let mut b = *self;
        *b.slot(c)
    }

    fn slot(&mut self, c: Category) -> &mut u64 {
        match c {
            Category::Parameters => &mut self.parameters,
            Category::Buffers => &mut self.buffers,
            Category::Gradients => &mut self.gradients,
            Category::Optimizer => &mut self.optimizer,
            Category::SavedActivations => &mut self.saved_activations,
            Category::Temporaries => &mut self.temporaries,
        }
    }
}

/// The replay of a schedule.
#[derive(Debug, Clone)]
pub struct Replay {
    /// Bytes by category live during each step.
    pub timeline: Vec<Breakdown>,
    /// Index of the peak step.
    pub peak_step: usize,
    /// Live intervals `[first, last]` step of every allocation of every storage.
    pub intervals: Vec<Vec<(usize, usize)>>,
}

impl Replay {
    /// The breakdown at the peak.
    pub fn peak(&self) -> Breakdown {
        self.timeline
            .get(self.peak_step)
            .copied()
            .unwrap_or_default()
    }
}

/// Live intervals of each storage over the steps.
pub fn intervals(s: &Schedule) -> Vec<Vec<(usize, usize)>> {
    let n = s.steps.len();
    let last = n.saturating_sub(1);
    // (step, is_write) per storage, in step order.
    let mut events: Vec<Vec<(usize, bool)>> = vec![Vec::new(); s.storages.len()];
    for (i, st) in s.steps.iter().enumerate() {
        for &w in &st.writes {
            events[w].push((i, true));
        }
        for &r in st.reads.iter().chain(&st.updates) {
            events[r].push((i, false));
        }
    }
    s.storages
        .iter()
        .zip(events)
        .map(|(st, ev)| {
            if st.persistent {
                return vec![(0, last)];
            }
            let mut out: Vec<(usize, usize)> = Vec::new();
            for (step, is_write) in ev {
                match out.last_mut() {
                    Some(cur) if !is_write || step == cur.1 => cur.1 = cur.1.max(step),
                    _ => out.push((step, step)),
                }
            }
            if st.held {
                if let Some(cur) = out.last_mut() {
                    cur.1 = last;
                }
            }
            out
        })
        .collect()
}

/// Replays a schedule.
pub fn simulate(s: &Schedule) -> Replay {
    let n = s.steps.len().max(1);
    let ivs = intervals(s);
    let mut delta = vec![[0i128; 6]; n + 1];
    for (st, iv) in s.storages.iter().zip(&ivs) {
        let c = CATEGORIES
            .iter()
            .position(|&c| c == category(st))
            .expect("listed");
        for &(a, b) in iv {
            delta[a][c] += st.bytes as i128;
            delta[b + 1][c] -= st.bytes as i128;
        }
    }
    let mut live = [0i128; 6];
    let mut timeline = Vec::with_capacity(n);
    for d in &delta[..n] {
        let mut b = Breakdown::default();
        for (k, c) in CATEGORIES.iter().enumerate() {
            live[k] += d[k];
            *b.slot(*c) = live[k] as u64;
        }
        timeline.push(b);
    }
    let peak_step = timeline
        .iter()
        .enumerate()
        .fold((0, 0), |best, (i, b)| {
            if b.total() > best.1 {
                (i, b.total())
            } else {
                best
            }
        })
        .0;
    Replay {
        timeline,
        peak_step,
        intervals: ivs,
    }
}
