//! What the process spent: CPU time (the process's CPU clock), minor page faults and
//! resident memory (read from Linux's /proc; elsewhere those readings are `None`).

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

/// CPU time of the process in nanoseconds, every thread's, those that exited included
/// (`CLOCK_PROCESS_CPUTIME_ID`, one call). Until session 47 this summed each thread's
/// `sum_exec_runtime` from /proc/self/task/*/schedstat: a file read per thread, and the
/// time of a thread that exited between two readings lost. utime + stime in
/// /proc/self/stat go by 10 ms ticks, too coarse for the short loops of small sizes.
fn cpu_ns() -> Option<u64> {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    if rc != 0 {
        return None;
    }
    let secs = u64::try_from(t.tv_sec).ok()?;
    let nanos = u64::try_from(t.tv_nsec).ok()?;
    secs.checked_mul(1_000_000_000)?.checked_add(nanos)
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

    /// The CPU time of the calling thread, from its own clock.
    fn thread_ns() -> u64 {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid, writable timespec for the call's duration.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        assert_eq!(rc, 0);
        t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
    }

    /// The process's CPU time takes in a short spin of the reading thread's right away,
    /// all of it (a count by ticks would read 2 ms as nothing, or as 10).
    #[test]
    fn a_running_threads_spin_is_counted_whole() {
        for _ in 0..20 {
            let before = cpu_ns().expect("the process clock");
            let start = thread_ns();
            let mut x = 0u64;
            while thread_ns() - start < 2_000_000 {
                x = x.wrapping_add(std::hint::black_box(1));
            }
            let spun = thread_ns() - start;
            let counted = cpu_ns().expect("the process clock") - before;
            assert!(x > 0);
            assert!(counted >= spun, "counted {counted} ns of a {spun} ns spin");
        }
    }

    /// CPU time and faults grow with work.
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
