//! Binding a worker's threads to CPUs of its own, as `mpirun --bind-to core` does.
//!
//! Several workers on one host each running fewer runtime threads than the host has CPUs
//! (`--threads 1`) otherwise wander between CPUs as the scheduler moves them, and every
//! move leaves their buffers and the kernel's socket state in another core's cache. Bound
//! round robin by their place among the workers on the host, 8 workers on 2 cores spent
//! 13-19% less CPU per byte on 1-4 MiB all-reduces and broadcasts, and 4 workers up to
//! 37% less on the collectives (one row of eight 2% more)
//! (BENCHMARKS.md, "Session 24").

use std::io;
use std::net::SocketAddr;

/// Launcher variables that give a worker's place among the workers on its host, in
/// order of precedence.
const LOCAL_RANK_VARS: [&str; 4] = [
    "NEXAR_LOCAL_RANK",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
];

/// A worker's place among the workers on its host: `(index, count)`. The index comes from
/// the launcher (through `get`) where it says, else from the ranks whose mesh address has
/// the same IP as `rank`'s, in rank order; the count is always the latter (at least 1).
pub(crate) fn host_place(
    addrs: &[SocketAddr],
    rank: usize,
    get: impl Fn(&str) -> Option<String>,
) -> (usize, usize) {
    let mine = addrs.get(rank).map(SocketAddr::ip);
    let same = |a: &SocketAddr| Some(a.ip()) == mine;
    let count = addrs.iter().filter(|a| same(a)).count().max(1);
    let index = LOCAL_RANK_VARS
        .iter()
        .find_map(|k| get(k).and_then(|v| v.trim().parse::<usize>().ok()))
        .unwrap_or_else(|| addrs.iter().take(rank).filter(|a| same(a)).count());
    (index, count)
}

/// The CPUs, of those this process may use (`allowed`, in order), for the worker at
/// `index` on its host running `threads` runtime threads: `threads` of them in a row,
/// starting at `index * threads` and wrapping around, so that workers take turns over the
/// CPUs. `None` when the worker would get every allowed CPU anyway.
pub(crate) fn cpus_for(allowed: &[usize], index: usize, threads: usize) -> Option<Vec<usize>> {
    let n = allowed.len();
    if threads == 0 || threads >= n {
        return None;
    }
    let start = index.wrapping_mul(threads) % n;
    Some((0..threads).map(|i| allowed[(start + i) % n]).collect())
}

/// The CPUs the calling thread may run on.
pub(crate) fn allowed_cpus() -> io::Result<Vec<usize>> {
    let set = affinity_of(0)?;
    Ok(members(&set).collect())
}

/// Thread `tid`'s CPU set (0: the calling thread).
fn affinity_of(tid: libc::pid_t) -> io::Result<libc::cpu_set_t> {
    // SAFETY: a zeroed `cpu_set_t` is an empty set; the kernel writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable `cpu_set_t` of the size given.
    let rc = unsafe { libc::sched_getaffinity(tid, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(set)
}

/// The CPUs in `set`.
fn members(set: &libc::cpu_set_t) -> impl Iterator<Item = usize> + '_ {
    let max = usize::try_from(libc::CPU_SETSIZE).unwrap_or(0);
    // SAFETY: every index is under CPU_SETSIZE, the set's capacity.
    (0..max).filter(move |&c| unsafe { libc::CPU_ISSET(c, set) })
}

/// The ids of this process's threads.
fn threads() -> io::Result<Vec<libc::pid_t>> {
    let mut tids = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task")? {
        if let Some(tid) = entry?.file_name().to_str().and_then(|s| s.parse().ok()) {
            tids.push(tid);
        }
    }
    Ok(tids)
}

/// Restricts every thread of this process to `cpus` (threads started later inherit it
/// from the thread that starts them) and returns the CPUs that its threads may then run
/// on, all together, as the kernel reports them.
pub(crate) fn bind_process(cpus: &[usize]) -> io::Result<Vec<usize>> {
    // SAFETY: as in `affinity_of`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = usize::try_from(libc::CPU_SETSIZE).unwrap_or(0);
    for &c in cpus.iter().filter(|&&c| c < max) {
        // SAFETY: `c` is under CPU_SETSIZE, the set's capacity.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // A thread may start while the list is read, from a thread not yet bound: read again
    // until a pass finds no thread it had not bound before (bounded: threads are few).
    let mut bound = std::collections::HashSet::new();
    for _ in 0..8 {
        let fresh: Vec<_> = threads()?
            .into_iter()
            .filter(|t| bound.insert(*t))
            .collect();
        if fresh.is_empty() {
            break;
        }
        for tid in fresh {
            // SAFETY: `set` is a valid `cpu_set_t` of the size given.
            if unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) } != 0 {
                let e = io::Error::last_os_error();
                // A thread that ended meanwhile is no longer there to bind.
                if e.raw_os_error() != Some(libc::ESRCH) {
                    return Err(e);
                }
            }
        }
    }
    let mut all = std::collections::BTreeSet::new();
    for tid in threads()? {
        match affinity_of(tid) {
            Ok(set) => all.extend(members(&set)),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(all.into_iter().collect())
}

/// Describes a list of CPUs as the kernel does (`0-3,6`).
pub(crate) fn cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if j == i {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter()
            .map(|a| a.parse().expect("an address"))
            .collect()
    }

    #[test]
    fn a_workers_place_counts_the_ranks_at_its_ip() {
        let a = addrs(&[
            "10.0.0.1:1",
            "10.0.0.2:1",
            "10.0.0.1:2",
            "10.0.0.2:2",
            "10.0.0.1:3",
        ]);
        let none = |_: &str| None;
        assert_eq!(host_place(&a, 0, none), (0, 3));
        assert_eq!(host_place(&a, 2, none), (1, 3));
        assert_eq!(host_place(&a, 4, none), (2, 3));
        assert_eq!(host_place(&a, 3, none), (1, 2));
        // The launcher's word wins for the index.
        let env = |k: &str| (k == "LOCAL_RANK").then(|| " 5".to_string());
        assert_eq!(host_place(&a, 2, env), (5, 3));
        let bad = |k: &str| (k == "NEXAR_LOCAL_RANK").then(|| "x".to_string());
        assert_eq!(host_place(&a, 2, bad), (1, 3));
        // A rank outside the list is alone.
        assert_eq!(host_place(&a, 9, none).1, 1);
    }

    #[test]
    fn workers_take_turns_over_the_cpus() {
        let cpus = [0, 1];
        let picks: Vec<_> = (0..4).map(|i| cpus_for(&cpus, i, 1)).collect();
        assert_eq!(
            picks,
            vec![Some(vec![0]), Some(vec![1]), Some(vec![0]), Some(vec![1])]
        );
        // Allowed CPUs need not be contiguous; a worker's threads get CPUs in a row.
        let cpus = [2, 3, 6, 7, 9];
        assert_eq!(cpus_for(&cpus, 0, 2), Some(vec![2, 3]));
        assert_eq!(cpus_for(&cpus, 1, 2), Some(vec![6, 7]));
        assert_eq!(cpus_for(&cpus, 2, 2), Some(vec![9, 2]));
        // A worker with a thread per CPU (or more) is left alone.
        assert_eq!(cpus_for(&cpus, 1, 5), None);
        assert_eq!(cpus_for(&[0], 3, 1), None);
        assert_eq!(cpus_for(&[], 0, 1), None);
    }

    #[test]
    fn cpu_lists_are_written_as_the_kernel_writes_them() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(cpu_list(&[1]), "1");
        assert_eq!(cpu_list(&[]), "");
    }
}
