//! Workers that share a host: how many there are, which one this is, and binding each
//! one's threads to CPUs of its own, as `mpirun --bind-to core` does.
//!
//! Several workers on one host each running fewer runtime threads than the host has CPUs
//! (`--threads 1`) otherwise wander between CPUs as the scheduler moves them, and every
//! move leaves their buffers and the kernel's socket state in another core's cache. Bound
//! round robin by their place among the workers on the host, 8 workers on 2 cores spent
//! 13-19% less CPU per byte on 1-4 MiB all-reduces and broadcasts, and 4 workers up to
//! 37% less on the collectives (one row of eight 2% more) (bench/HISTORY.md, "Session 24").
//! Binding is Linux only (`sched_setaffinity`), for hosts of up to 1024 CPUs (the size of
//! libc's `cpu_set_t`; beyond, the kernel refuses the call and the worker says so).

#[cfg(target_os = "linux")]
use std::io;
use std::net::SocketAddr;

/// Launcher variables that say how many workers share this host, in order of precedence.
const LOCAL_WORKERS_VARS: [&str; 4] = [
    "NEXAR_LOCAL_WORKERS",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
];

/// Launcher variables that give a worker's place among the workers on its host, in
/// order of precedence.
const LOCAL_RANK_VARS: [&str; 4] = [
    "NEXAR_LOCAL_RANK",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
];

/// The first of `vars` that `get` gives a number for.
fn launcher_number(vars: &[&str], get: &impl Fn(&str) -> Option<String>) -> Option<usize> {
    vars.iter()
        .find_map(|k| get(k).and_then(|v| v.trim().parse::<usize>().ok()))
}

/// How many workers share this host, as the launcher says (through `get`), if it does.
pub(crate) fn local_workers(get: &impl Fn(&str) -> Option<String>) -> Option<usize> {
    launcher_number(&LOCAL_WORKERS_VARS, get).filter(|n| *n > 0)
}

/// A worker's place among the workers on its host: `(index, count)`. The count is the
/// number of ranks whose mesh address has the same IP as `rank`'s (at least 1); the index
/// is the launcher's local rank (through `get`) where the launcher's count of local
/// workers agrees with it and the index is under it, else `rank`'s place among those
/// ranks. (A local rank passed on unchanged to several workers, as when one launcher task
/// starts them all, would otherwise put them all in the same place.)
pub(crate) fn host_place(
    addrs: &[SocketAddr],
    rank: usize,
    get: impl Fn(&str) -> Option<String>,
) -> (usize, usize) {
    let mine = addrs.get(rank).map(|a| a.ip().to_canonical());
    let same = |a: &SocketAddr| Some(a.ip().to_canonical()) == mine;
    let count = addrs.iter().filter(|a| same(a)).count().max(1);
    let told = launcher_number(&LOCAL_RANK_VARS, &get)
        .filter(|i| *i < count && local_workers(&get) == Some(count));
    let index = told.unwrap_or_else(|| addrs.iter().take(rank).filter(|a| same(a)).count());
    (index, count)
}

/// The CPUs, of those this process may use (`allowed`, in order), for the worker at
/// `index` on its host running `threads` runtime threads: `threads` of them in a row,
/// starting at `index * threads` and wrapping around, so that workers take turns over the
/// CPUs. `None` when the worker would get every allowed CPU anyway, or when `usable` (the
/// CPUs' worth of time the process may use) is under the allowed CPUs: a CPU quota (a
/// container's), not the CPUs, then sets its share, and workers of other jobs bound the
/// same way would crowd onto the same few CPUs.
pub(crate) fn cpus_for(
    allowed: &[usize],
    usable: usize,
    index: usize,
    threads: usize,
) -> Option<Vec<usize>> {
    let n = allowed.len();
    if threads == 0 || threads >= n || usable < n {
        return None;
    }
    let start = index.wrapping_mul(threads) % n;
    Some((0..threads).map(|i| allowed[(start + i) % n]).collect())
}

/// The CPUs the calling thread may run on.
#[cfg(target_os = "linux")]
pub(crate) fn allowed_cpus() -> io::Result<Vec<usize>> {
    let set = affinity_of(0)?;
    Ok(members(&set).collect())
}

/// Thread `tid`'s CPU set (0: the calling thread).
#[cfg(target_os = "linux")]
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
#[cfg(target_os = "linux")]
fn members(set: &libc::cpu_set_t) -> impl Iterator<Item = usize> + '_ {
    let max = usize::try_from(libc::CPU_SETSIZE).unwrap_or(0);
    // SAFETY: every index is under CPU_SETSIZE, the set's capacity.
    (0..max).filter(move |&c| unsafe { libc::CPU_ISSET(c, set) })
}

/// The ids of this process's threads.
#[cfg(target_os = "linux")]
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
#[cfg(target_os = "linux")]
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
#[cfg(any(target_os = "linux", test))]
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
            "[::ffff:10.0.0.1]:3",
        ]);
        let none = |_: &str| None;
        assert_eq!(host_place(&a, 0, none), (0, 3));
        assert_eq!(host_place(&a, 2, none), (1, 3));
        // An IPv4-mapped IPv6 address is the same host.
        assert_eq!(host_place(&a, 4, none), (2, 3));
        assert_eq!(host_place(&a, 3, none), (1, 2));
        // A rank outside the list is alone.
        assert_eq!(host_place(&a, 9, none).1, 1);
    }

    /// The launcher's local rank counts only where its count of local workers agrees with
    /// the addresses and the rank is under it.
    #[test]
    fn a_launchers_local_rank_counts_where_its_count_agrees() {
        let a = addrs(&["10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3"]);
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let agreed = env(&[("LOCAL_RANK", " 2"), ("LOCAL_WORLD_SIZE", "3")]);
        assert_eq!(host_place(&a, 0, agreed), (2, 3));
        // One local rank handed to every worker (no count, another count, or out of
        // range): the place by rank.
        assert_eq!(host_place(&a, 1, env(&[("SLURM_LOCALID", "0")])), (1, 3));
        let other = env(&[("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")]);
        assert_eq!(host_place(&a, 1, other), (1, 3));
        let beyond = env(&[("NEXAR_LOCAL_RANK", "3"), ("NEXAR_LOCAL_WORKERS", "3")]);
        assert_eq!(host_place(&a, 2, beyond), (2, 3));
        let bad = env(&[("NEXAR_LOCAL_RANK", "x"), ("LOCAL_WORLD_SIZE", "3")]);
        assert_eq!(host_place(&a, 2, bad), (2, 3));
    }

    #[test]
    fn workers_take_turns_over_the_cpus() {
        let cpus = [0, 1];
        let picks: Vec<_> = (0..4).map(|i| cpus_for(&cpus, 2, i, 1)).collect();
        assert_eq!(
            picks,
            vec![Some(vec![0]), Some(vec![1]), Some(vec![0]), Some(vec![1])]
        );
        // Allowed CPUs need not be contiguous; a worker's threads get CPUs in a row.
        let cpus = [2, 3, 6, 7, 9];
        assert_eq!(cpus_for(&cpus, 5, 0, 2), Some(vec![2, 3]));
        assert_eq!(cpus_for(&cpus, 5, 1, 2), Some(vec![6, 7]));
        assert_eq!(cpus_for(&cpus, 5, 2, 2), Some(vec![9, 2]));
        // A worker with a thread per CPU (or more) is left alone.
        assert_eq!(cpus_for(&cpus, 5, 1, 5), None);
        assert_eq!(cpus_for(&[0], 1, 3, 1), None);
        assert_eq!(cpus_for(&[], 0, 0, 1), None);
        // So is one under a CPU quota smaller than the CPUs it may run on.
        assert_eq!(cpus_for(&cpus, 4, 0, 1), None);
    }

    #[test]
    fn cpu_lists_are_written_as_the_kernel_writes_them() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(cpu_list(&[1]), "1");
        assert_eq!(cpu_list(&[]), "");
    }
}
