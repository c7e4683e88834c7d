//! Which live member owns which partition: rendezvous hashing over the members of a
//! membership topic (dequeue brokers own queue partitions, counters own shards).
//! Every member computes the same answer from the same membership, so a worker can
//! ask any broker, and when a member joins or leaves only the partitions it wins or
//! held move. Members are named stably (a counter by its host and data directory),
//! so a restarted member gets back the partitions whose state it keeps.

use std::collections::BTreeMap;

/// A live member: its name and where it is reached (a broker's worker API, a
/// counter's read API).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    pub instance: String,
    pub addr: String,
}

fn score(instance: &str, queue: &str, partition: i32) -> u64 {
    // FNV-1a over the three parts, then a final mix: stable across builds.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for bytes in [instance.as_bytes(), &[0], queue.as_bytes(), &[0], &partition.to_be_bytes()] {
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^ (hash >> 33)
}

/// The owner of `queue`'s `partition` among `members` (none when there are none);
/// `queue` names any family of partitions (a counter's: the shard topic).
pub fn owner<'a>(members: &'a [Member], queue: &str, partition: i32) -> Option<&'a Member> {
    members.iter().max_by_key(|m| (score(&m.instance, queue, partition), &m.instance))
}

/// The owners of partitions `0..count` of `queue` among `members`, balanced: every
/// member holds `count / members` of them or one more. Pairs of (partition, member)
/// are taken by descending score, each partition going to the first member of its
/// pairs with room, so every member computes the same answer from the same
/// members, and a member joining or leaving moves few partitions besides its own.
/// (Counters use this for their eight-odd shards, where plain rendezvous hashing
/// can leave a counter with none.)
pub fn balanced<'a>(members: &'a [Member], queue: &str, count: u32) -> Vec<Option<&'a Member>> {
    let mut owners: Vec<Option<&Member>> = vec![None; count as usize];
    if members.is_empty() {
        return owners;
    }
    let (base, mut extra) = (count as usize / members.len(), count as usize % members.len());
    let mut pairs: Vec<(u64, usize, u32)> = (0..count)
        .flat_map(|p| {
            members.iter().enumerate().map(move |(m, member)| (score(&member.instance, queue, p as i32), m, p))
        })
        .collect();
    pairs.sort_unstable_by(|a, b| {
        b.0.cmp(&a.0).then_with(|| members[b.1].instance.cmp(&members[a.1].instance)).then(a.2.cmp(&b.2))
    });
    let mut load = vec![0usize; members.len()];
    for (_, m, p) in pairs {
        if owners[p as usize].is_some() {
            continue;
        }
        let room = load[m] < base || (load[m] == base && extra > 0);
        if room {
            if load[m] == base {
                extra -= 1;
            }
            load[m] += 1;
            owners[p as usize] = Some(&members[m]);
        }
    }
    owners
}

/// Each partition's standbys among `members`, up to `replicas` of them, in order:
/// the first is the member [`balanced`] gives the partition once its owner is
/// gone, the second the one it gives once the owner and the first are gone, and
/// so on. So standbys are spread by the same balanced assignment, never on the
/// owner, and when one member leaves each of its partitions goes to its first
/// standby. Every member computes the same answer from the same members.
pub fn standbys<'a>(members: &'a [Member], queue: &str, count: u32, replicas: usize) -> Vec<Vec<&'a Member>> {
    let owners = balanced(members, queue, count);
    let mut chains: Vec<Vec<&Member>> = owners.iter().map(|owner| owner.iter().copied().collect()).collect();
    for _ in 0..replicas.min(members.len().saturating_sub(1)) {
        // Partitions whose chains exclude the same members share one assignment.
        let mut by_excluded: BTreeMap<Vec<&str>, Vec<usize>> = BTreeMap::new();
        for (partition, chain) in chains.iter().enumerate() {
            let mut excluded: Vec<&str> = chain.iter().map(|m| m.instance.as_str()).collect();
            excluded.sort_unstable();
            by_excluded.entry(excluded).or_default().push(partition);
        }
        for (excluded, partitions) in by_excluded {
            let rest: Vec<Member> =
                members.iter().filter(|m| !excluded.contains(&m.instance.as_str())).cloned().collect();
            let next = balanced(&rest, queue, count);
            for partition in partitions {
                let found = next[partition].and_then(|m| members.iter().find(|member| member.instance == m.instance));
                chains[partition].extend(found);
            }
        }
    }
    chains.into_iter().map(|chain| chain.into_iter().skip(1).collect()).collect()
}

/// Every partition of every queue (`queue` → partition count) `instance` owns.
pub fn owned_by(members: &[Member], queues: &BTreeMap<String, i32>, instance: &str) -> Vec<(String, i32)> {
    queues
        .iter()
        .flat_map(|(queue, &partitions)| (0..partitions).map(move |p| (queue.clone(), p)))
        .filter(|(queue, p)| owner(members, queue, *p).is_some_and(|m| m.instance == instance))
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn members(n: usize) -> Vec<Member> {
        (0..n).map(|i| Member { instance: format!("b{i}"), addr: format!("h:{i}") }).collect()
    }

    proptest! {
        /// Every partition has exactly one owner; removing a broker moves only the
        /// partitions it owned.
        #[test]
        fn one_owner_and_minimal_moves(n in 1usize..6, gone in 0usize..6, partitions in 1i32..40) {
            let all = members(n);
            let queues = BTreeMap::from([("q".to_string(), partitions)]);
            let total: usize = all.iter().map(|m| owned_by(&all, &queues, &m.instance).len()).sum();
            prop_assert_eq!(total, partitions as usize);
            let gone = gone % n;
            let rest: Vec<Member> = all.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, m)| m.clone()).collect();
            for p in 0..partitions {
                let before = owner(&all, "q", p).unwrap();
                if before.instance != all[gone].instance {
                    prop_assert_eq!(owner(&rest, "q", p), Some(before));
                }
            }
        }
    }

    proptest! {
        /// Balanced: every partition has one owner, loads differ by at most one, and
        /// a member leaving moves, besides its own, about one share more at most.
        #[test]
        fn balanced_owners_are_even_and_mostly_stable(n in 1usize..9, gone in 0usize..9, count in 1u32..40) {
            let all = members(n);
            let owners = balanced(&all, "s", count);
            prop_assert!(owners.iter().all(Option::is_some));
            let load = |owners: &[Option<&Member>], m: &Member| owners.iter().filter(|o| **o == Some(m)).count();
            let loads: Vec<usize> = all.iter().map(|m| load(&owners, m)).collect();
            let (min, max) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
            prop_assert!(max - min <= 1, "{:?}", loads);
            prop_assert_eq!(loads.iter().sum::<usize>(), count as usize);
            if n > 1 {
                let gone = gone % n;
                let rest: Vec<Member> = all.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, m)| m.clone()).collect();
                let after = balanced(&rest, "s", count);
                let moved = (0..count as usize).filter(|&p| owners[p] != Some(&all[gone]) && after[p].map(|m| &m.instance) != owners[p].map(|m| &m.instance)).count();
                // Besides the leaver's own share, the "one more" slots of a count that
                // does not divide evenly shift: up to about half the members' (a scan
                // of 40 sets of pod names, 2-8 members, 1-64 shards: at most n/2).
                prop_assert!(moved <= count as usize / n + n / 2, "{} moved besides the leaver's", moved);
            }
        }
    }

    proptest! {
        /// Standbys: as many as asked (or as there are other members), all distinct
        /// and never the owner; when the owner leaves, the partition goes to its first
        /// standby.
        #[test]
        fn standbys_are_where_owners_go(n in 1usize..8, gone in 0usize..8, count in 1u32..40, replicas in 0usize..3) {
            let all = members(n);
            let owners = balanced(&all, "s", count);
            let chains = standbys(&all, "s", count, replicas);
            prop_assert_eq!(chains.len(), count as usize);
            for (p, chain) in chains.iter().enumerate() {
                prop_assert_eq!(chain.len(), replicas.min(n - 1));
                let mut names: Vec<&str> = chain.iter().map(|m| m.instance.as_str()).collect();
                names.push(owners[p].unwrap().instance.as_str());
                names.sort_unstable();
                names.dedup();
                prop_assert_eq!(names.len(), chain.len() + 1, "partition {}: {:?}", p, chain);
            }
            if n > 1 && replicas > 0 {
                let gone = &all[gone % n];
                let rest: Vec<Member> = all.iter().filter(|m| *m != gone).cloned().collect();
                let after = balanced(&rest, "s", count);
                for p in 0..count as usize {
                    if owners[p] == Some(gone) {
                        prop_assert_eq!(after[p].map(|m| &m.instance), Some(&chains[p][0].instance));
                    }
                }
            }
        }
    }

    #[test]
    fn partitions_spread_over_brokers() {
        let all = members(2);
        let queues = BTreeMap::from([("jobs".to_string(), 16)]);
        let first = owned_by(&all, &queues, "b0").len();
        assert!((3..=13).contains(&first), "{first} of 16 on b0");
        assert!(owner(&[], "jobs", 0).is_none());
    }
}
