//! A data-parallel replica's rank under tensor and pipeline parallelism, and the
//! module trees of the steps, shared across batches.

use std::sync::Arc;

use super::{combo, Combo, Steps};
use crate::error::{Error, Result};
use crate::memory::device::replay_schedule;
use crate::remat::modules::ModuleTree;
use crate::train::Schedule;

impl Steps<'_> {
    /// The module tree of `s`, the partitioned step of `c` at some batch: the same
    /// at every batch, built once.
    pub(super) fn tree(&self, c: Combo, s: &Schedule) -> Arc<ModuleTree> {
        // The steps' names fingerprint the structure (a model lowered per batch
        // changes them).
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for st in &s.steps {
            std::hash::Hash::hash(&st.name, &mut h);
        }
        let key = (
            c.mixed,
            c.accumulate,
            c.mp,
            c.dist,
            std::hash::Hasher::finish(&h),
        );
        self.trees
            .get(key, || Ok(Arc::new(ModuleTree::of_schedule(s))))
            .expect("building a module tree cannot fail")
    }

    /// Whether the model can be split as `mp` says (its Linear layers' roles
    /// known, blocks enough for the stages): the layout's error means no.
    pub fn takes(&self, mp: combo::Mp) -> Result<bool> {
        if mp == combo::Mp::NONE {
            return Ok(true);
        }
        let c = Combo { mp, ..Combo::PLAIN };
        match self.replica_rank(c, self.schedule(c, 1)?, 1) {
            Ok(_) => Ok(true),
            Err(Error::Graph(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The worst rank's step of `c`'s tensor- and pipeline-parallel replica
    /// ([`crate::parallel::ranks`]; `s` itself without model parallelism).
    pub(super) fn replica_rank(
        &self,
        c: Combo,
        s: Arc<Schedule>,
        batch: u64,
    ) -> Result<Arc<Schedule>> {
        if c.mp == combo::Mp::NONE {
            return Ok(s);
        }
        let key = (c.mp, c.mixed, c.accumulate, batch);
        self.ranked.get(key, || self.worst_rank(c, &s))
    }

    /// The rank of `c`'s replica that needs the most: on a device, as `profile`
    /// chooses, the most reserved bytes (replayed without a limit), else the highest
    /// live peak; the first of equals.
    fn worst_rank(&self, c: Combo, s: &Schedule) -> Result<Arc<Schedule>> {
        let names: Vec<String> = (0..s.tensor_storage.len())
            .map(|t| self.model.graph.tensor(t).name.to_string())
            .collect();
        let ranks = crate::parallel::ranks(s.clone(), &names, &c.mp.layout(c.mp.pp))
            .map_err(Error::Graph)?;
        let reserved = |r: &Schedule| {
            self.o
                .device
                .as_ref()
                .and_then(|d| replay_schedule(r, &super::fit_device::unlimited(d)).ok())
                .map_or(0, |a| a.reserved_bytes)
        };
        // The first of equals, as profile takes it.
        let worst = ranks
            .into_iter()
            .enumerate()
            .max_by_key(|(i, r)| {
                let need = match self.o.device {
                    Some(_) => reserved(&r.schedule),
                    None => crate::memory::simulate(&r.schedule).peak().total(),
                };
                (need, std::cmp::Reverse(*i))
            })
            .map(|(_, r)| r)
            .expect("one rank at least");
        Ok(Arc::new(worst.schedule))
    }
}
