//! The eviction rules of the simulation ([`super`]): a rule's score, and the
//! grid of rules the planner tries.

/// One eviction rule: score `c^cost / (bytes · dist^dist_exp · stale^stale_exp)`,
/// smallest evicted first.
#[derive(Debug, Clone, Copy)]
pub struct Heuristic {
    /// What evicting a value costs in the score's numerator.
    pub weight: Weight,
    /// Exponent of the distance to the value's next use in the schedule.
    pub dist_exp: f64,
    /// Exponent of the time since the value was last used.
    pub stale_exp: f64,
    /// Free values that nothing in the schedule reads again at once (true), or keep
    /// them resident, first in line for eviction, for later recomputations (false).
    pub eager: bool,
    /// Pin each input of a node when its turn comes in the Sethi–Ullman order, the
    /// resident ones included (true), or pin the resident inputs first (false).
    /// Lazy pinning lets an input that is resident but cheap to rebuild be evicted
    /// while a sibling that needs more transient memory is made resident, and be
    /// rebuilt after it: the order that needs the least memory to make the inputs
    /// resident from nothing when they share no ancestors (exact for trees), which
    /// reaches lower peaks at the price of more recomputation.
    pub lazy: bool,
}

/// The numerator of a [`Heuristic`]'s score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weight {
    /// The recompute cost (the writer, plus the writers of its evicted inputs).
    Cost,
    /// The transient memory to make the value resident again from nothing: keeps
    /// the values whose recomputation would need the most memory (for low peaks).
    Memory,
    /// Nothing: evict by size and distance only.
    Size,
}

/// Index in [`HEURISTICS`] of the cost rule `[0]` pinning lazily.
pub const LAZY_COST: usize = 10;
/// Index in [`HEURISTICS`] of the memory rule `[8]` pinning lazily.
pub const LAZY_MEMORY: usize = 11;
/// The lazy rules, in the order the runs for the lowest peak try them.
pub(super) const LAZY: [usize; 2] = [LAZY_MEMORY, LAZY_COST];
/// The rules that pin first which the runs for the lowest peak aim at the floor.
pub(super) const PEAK_RULES: [usize; 4] = [8, 6, 3, 0];

impl Heuristic {
    /// The same rule, pinning lazily.
    pub const fn pinning_lazily(self) -> Heuristic {
        Heuristic { lazy: true, ..self }
    }
}

/// The cost rule, `HEURISTICS[0]`.
const COST: Heuristic = Heuristic {
    weight: Weight::Cost,
    dist_exp: 1.0,
    stale_exp: 0.0,
    eager: false,
    lazy: false,
};

/// The memory rule, `HEURISTICS[8]`.
const MEMORY: Heuristic = Heuristic {
    weight: Weight::Memory,
    dist_exp: 1.0,
    stale_exp: 0.0,
    eager: false,
    lazy: false,
};

/// The grid of rules tried, cheapest to reach first (the last two pin lazily:
/// [`LAZY_COST`], [`LAZY_MEMORY`]).
pub const HEURISTICS: [Heuristic; 12] = [
    COST,
    Heuristic {
        weight: Weight::Cost,
        dist_exp: 1.0,
        stale_exp: 0.0,
        eager: true,
        lazy: false,
    },
    Heuristic {
        weight: Weight::Cost,
        dist_exp: 2.0,
        stale_exp: 0.0,
        eager: false,
        lazy: false,
    },
    Heuristic {
        weight: Weight::Cost,
        dist_exp: 0.5,
        stale_exp: 0.0,
        eager: false,
        lazy: false,
    },
    Heuristic {
        weight: Weight::Cost,
        dist_exp: 0.0,
        stale_exp: 1.0,
        eager: false,
        lazy: false,
    },
    Heuristic {
        weight: Weight::Cost,
        dist_exp: 1.0,
        stale_exp: 1.0,
        eager: false,
        lazy: false,
    },
    Heuristic {
        weight: Weight::Size,
        dist_exp: 1.0,
        stale_exp: 0.0,
        eager: false,
        lazy: false,
    },
    Heuristic {
        weight: Weight::Size,
        dist_exp: 1.0,
        stale_exp: 0.0,
        eager: true,
        lazy: false,
    },
    MEMORY,
    Heuristic {
        weight: Weight::Memory,
        dist_exp: 0.0,
        stale_exp: 0.0,
        eager: false,
        lazy: false,
    },
    COST.pinning_lazily(),
    MEMORY.pinning_lazily(),
];
