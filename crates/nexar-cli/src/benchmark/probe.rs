//! What the process spent: CPU time, minor page faults and resident memory, read from
//! Linux's /proc without new dependencies. Elsewhere every reading is `None`.

use std::fs;

/// Process-wide counters at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    /// CPU time of every thread, in nanoseconds.
    pub(crate) cpu_ns: Option<u64>,
    /// Minor page faults of the process since it started.
    pub(crate) minflt: Option<u64>,
}

impl Counters {
    /// Reads the counters now.
    pub(crate) fn now() -> Counters {
        Counters {
            cpu_ns: cpu_ns(),
            minflt: minflt(),
        }
    }

    /// What was spent from `self` to `later`.
    pub(crate) fn until(self, later: Counters) -> Counters {
        let diff = |a: Option<u64>, b: Option<u64>| Some(b?.saturating_sub(a?));
        Counters {
            cpu_ns: diff(self.cpu_ns, later.cpu_ns),
            minflt: diff(self.minflt, later.minflt),
        }
    }
}

/// CPU time of the process in nanoseconds: the sum of `sum_exec_runtime` (the first field
/// of /proc/self/task/*/schedstat) over its threads. Unlike utime + stime in
/// /proc/self/stat (10 ms ticks), this resolves the short loops of small sizes; the tokio
/// workers and the quinn drivers live as long as the process, so no thread's time is lost
/// to it exiting between two readings.
fn cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    let mut any = false;
    for task in fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(text) = fs::read_to_string(task.path().join("schedstat")) else {
            continue; // the thread exited meanwhile
        };
        if let Some(ns) = text
            .split_whitespace()
            .next()
            .and_then(|f| f.parse::<u64>().ok())
        {
            total += ns;
            any = true;
        }
    }
    any.then_some(total)
}

/// Minor faults (field 10 of /proc/self/stat).
fn minflt() -> Option<u64> {
    let stat = fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces; the fields after it are plain.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(7)?.parse().ok()
}

/// A `kB` line of /proc/self/status, in bytes.
fn status_bytes(key: &str) -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Resident memory now (VmRSS), in bytes.
pub(crate) fn rss() -> Option<u64> {
    status_bytes("VmRSS")
}

/// Peak resident memory (VmHWM) since the process started or since [`reset_peak`].
pub(crate) fn peak_rss() -> Option<u64> {
    status_bytes("VmHWM")
}

/// Resets VmHWM to the current RSS (writes `5` to /proc/self/clear_refs); false if the
/// kernel refused.
pub(crate) fn reset_peak() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// CPU time and faults grow with work. The CPU time sums the threads alive at each
    /// reading, and the harness's threads of other tests exit meanwhile, taking theirs
    /// along: so the work is repeated (at most 50 times) until a reading with no thread
    /// gone shows it.
    #[test]
    fn counters_move_forward() {
        let mut spent = Counters::default();
        for _ in 0..50 {
            let before = Counters::now();
            // Burn a little CPU and touch fresh pages.
            let v: Vec<u8> = vec![1; 8 << 20];
            let sum: u64 = v.iter().map(|&b| u64::from(b)).sum();
            assert_eq!(sum, 8 << 20);
            spent = before.until(Counters::now());
            if spent.cpu_ns.is_some_and(|ns| ns > 0) {
                break;
            }
        }
        assert!(spent.cpu_ns.is_some_and(|ns| ns > 0), "{spent:?}");
        assert!(spent.minflt.is_some_and(|f| f > 0), "{spent:?}");
        assert!(rss().is_some_and(|r| r > 0));
        assert!(peak_rss().is_some_and(|r| r > 0));
    }
}
