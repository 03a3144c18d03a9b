//! Lost host updates (Feng, Xu and Li §4.4 and §5.3): each host's contribution to an
//! iteration's reduction is lost with probability `p`, and the coordinator uses that host's last
//! delivered one instead, as the live coordinator does with a straggler's
//! (`protocol::coordinator`, bounded staleness). The host itself has stepped: only its message is
//! lost. Seeded, so a run is reproducible bit for bit; one draw per host per iteration in host
//! order, whatever the outcome, so the pattern of losses does not depend on the algorithm.

use crate::rng::SplitMix64;

/// Loss probability and seed of the pattern.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Loss {
    pub probability: f64,
    pub seed: u64,
}

/// The coordinator's view of the hosts' contributions under loss.
#[derive(Clone, Debug)]
pub struct LossyChannel<T> {
    probability: f64,
    rng: SplitMix64,
    held: Vec<T>,
    lost: u64,
}

impl<T> LossyChannel<T> {
    /// Starts from contributions every host delivered (its join).
    pub fn new(loss: Loss, initial: Vec<T>) -> Self {
        Self {
            probability: loss.probability,
            rng: SplitMix64::new(loss.seed),
            held: initial,
            lost: 0,
        }
    }

    /// Delivers this iteration's contributions, one per host: each is lost with the channel's
    /// probability, the host's last delivered one standing in. Returns what the coordinator holds.
    pub fn deliver(&mut self, fresh: Vec<T>) -> &[T] {
        assert_eq!(fresh.len(), self.held.len(), "one contribution per host");
        for (held, fresh) in self.held.iter_mut().zip(fresh) {
            if self.rng.unit() < self.probability {
                self.lost += 1;
            } else {
                *held = fresh;
            }
        }
        &self.held
    }

    /// Replaces every held contribution, e.g. after selection changed what hosts contribute.
    pub fn reset(&mut self, current: Vec<T>) {
        self.held = current;
    }

    /// Contributions lost so far.
    pub fn lost(&self) -> u64 {
        self.lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(probability: f64, seed: u64) -> (Vec<Vec<u32>>, u64) {
        let mut ch = LossyChannel::new(Loss { probability, seed }, vec![0u32; 50]);
        let seen = (1..=40)
            .map(|it| ch.deliver(vec![it; 50]).to_vec())
            .collect();
        (seen, ch.lost())
    }

    #[test]
    fn nothing_is_lost_at_zero_and_everything_at_one() {
        let (seen, lost) = run(0.0, 7);
        assert_eq!(lost, 0);
        for (it, held) in seen.iter().enumerate() {
            assert!(held.iter().all(|&v| v == it as u32 + 1));
        }
        let (seen, lost) = run(1.0, 7);
        assert_eq!(lost, 40 * 50);
        assert!(seen.iter().flatten().all(|&v| v == 0), "the joins stay");
    }

    #[test]
    fn a_lost_contribution_is_replaced_by_the_hosts_last_and_the_rate_is_p() {
        let (seen, lost) = run(0.1, 3);
        assert!(
            (150..=250).contains(&lost),
            "{lost} of 2000 lost at p = 0.1"
        );
        for (it, held) in seen.iter().enumerate().skip(1) {
            for (host, &v) in held.iter().enumerate() {
                let before = seen[it - 1][host];
                assert!(v == it as u32 + 1 || v == before, "host {host} holds {v}");
            }
        }
        assert_eq!(run(0.1, 3), (seen, lost), "a seeded run repeats");
        assert_ne!(run(0.1, 4).0, run(0.1, 3).0, "another seed loses others");
    }
}
