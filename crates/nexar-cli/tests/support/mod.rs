//! Running `nexar` processes from tests: every wait has a deadline, and a process still
//! running when its handle drops (a failed assertion, a panic) is killed.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Launcher variables a worker reads (`nexar worker --help`), and tokio's count of
/// runtime threads: a test that runs under a launcher, or in a shell that set one, must
/// not pass them on unawares.
const LAUNCHER_VARS: [&str; 24] = [
    "TOKIO_WORKER_THREADS",
    "NEXAR_JOIN",
    "NEXAR_SEED",
    "NEXAR_SECRET",
    "NEXAR_SECRET_FILE",
    "NEXAR_SEED_FINGERPRINT",
    "NEXAR_RANK",
    "NEXAR_WORLD_SIZE",
    "NEXAR_LISTEN",
    "NEXAR_ADVERTISE",
    "NEXAR_LOCAL_WORKERS",
    "NEXAR_LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_LOCALID",
];

/// The `nexar` binary under test, without the launcher variables of the test's own
/// environment (a test sets those it means to).
pub(crate) fn nexar() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nexar"));
    without_launcher(&mut cmd);
    cmd
}

/// Leaves the launcher variables of the test's own environment out of `cmd`'s.
pub(crate) fn without_launcher(cmd: &mut Command) -> &mut Command {
    for var in LAUNCHER_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// Starts `nexar seed --listen 127.0.0.1:0 --world N` with `extra` arguments and returns it
/// with the join string it printed (within 30 s).
#[allow(dead_code)]
pub(crate) fn spawn_seed(world: usize, extra: &[&str]) -> (Proc, String) {
    let world = world.to_string();
    let mut cmd = nexar();
    cmd.args(["seed", "--listen", "127.0.0.1:0", "--world", &world])
        .args(extra);
    let mut seed = Proc::spawn("seed", &mut cmd);
    let join = seed.line(Duration::from_secs(30));
    assert!(join.starts_with("nexar://127.0.0.1:"), "{join}");
    assert!(!join.starts_with("nexar://127.0.0.1:0/"), "{join}");
    (seed, join)
}

/// Starts `nexar worker --join JOIN --listen 127.0.0.1:0 ARGS...` (ARGS: worker flags,
/// then the job and its options).
#[allow(dead_code)]
pub(crate) fn spawn_worker(name: &str, join: &str, args: &[&str]) -> Proc {
    Proc::spawn(
        name,
        nexar()
            .args(["worker", "--join", join, "--listen", "127.0.0.1:0"])
            .args(args),
    )
}

/// How a process ended.
#[derive(Debug)]
pub(crate) struct Finished {
    /// The exit code (`None` if a signal ended it).
    pub(crate) code: Option<i32>,
    /// Standard output not already taken with [`Proc::line`] (lines read by
    /// [`Proc::until`] included).
    pub(crate) stdout: String,
    /// Standard error.
    pub(crate) stderr: String,
}

/// A running process whose output is collected by background threads.
pub(crate) struct Proc {
    name: String,
    child: Child,
    stdout: Receiver<String>,
    /// Lines read by [`Proc::until`], kept for [`Finished::stdout`].
    seen: Vec<String>,
    stdout_thread: Option<JoinHandle<()>>,
    stderr: Arc<Mutex<String>>,
    stderr_thread: Option<JoinHandle<()>>,
}

impl Proc {
    /// Starts `cmd` with piped stdout and stderr; `name` appears in failure messages.
    pub(crate) fn spawn(name: &str, cmd: &mut Command) -> Proc {
        Proc::start(name, cmd, true)
    }

    /// [`Proc::spawn`], with the read end of standard error closed at once (a reader that
    /// went away, as `2>&1 | head -1` leaves): every write to it fails.
    #[allow(dead_code)]
    pub(crate) fn spawn_with_stderr_closed(name: &str, cmd: &mut Command) -> Proc {
        Proc::start(name, cmd, false)
    }

    fn start(name: &str, cmd: &mut Command, keep_stderr: bool) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: could not start {cmd:?}: {e}"));
        let (tx, stdout) = mpsc::channel();
        let out = child.stdout.take().expect("piped stdout");
        let stdout_thread = std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().expect("piped stderr");
        let sink = stderr.clone();
        let stderr_thread = keep_stderr.then(|| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = err.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let text = String::from_utf8_lossy(&buf[..n]);
                    sink.lock().expect("stderr buffer").push_str(&text);
                }
            })
        });
        // Not kept, the read end goes with the closure `then` never calls: closed here.
        Proc {
            name: name.to_string(),
            child,
            stdout,
            seen: Vec::new(),
            stdout_thread: Some(stdout_thread),
            stderr,
            stderr_thread,
        }
    }

    /// Kills the process with SIGKILL, as a crash would.
    #[allow(dead_code)]
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
    }

    /// Sends SIGTERM, as a scheduler asking the process to stop would.
    #[allow(dead_code)]
    pub(crate) fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends SIGSTOP: the process stays, frozen, until it is killed (or continued).
    #[allow(dead_code)]
    pub(crate) fn freeze(&self) {
        self.signal("STOP");
    }

    /// Whether the process is still there (running or frozen), not exited.
    #[allow(dead_code)]
    pub(crate) fn is_there(&mut self) -> bool {
        self.child.try_wait().is_ok_and(|s| s.is_none())
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "{}: kill -{sig} failed",
            self.name
        );
    }

    /// Reads standard output until a line contains `pattern` (waiting until `deadline`);
    /// the lines read stay part of [`Finished::stdout`].
    #[allow(dead_code)]
    pub(crate) fn until(&mut self, pattern: &str, deadline: Instant) -> String {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(pattern) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "{}: no line with {pattern:?} before the deadline ({e}); stdout:\n{}\nstderr:\n{}",
                    self.name,
                    self.seen.join("\n"),
                    self.stderr_so_far()
                ),
            }
        }
    }

    /// The next line of standard output, waiting at most `timeout`.
    pub(crate) fn line(&mut self, timeout: Duration) -> String {
        match self.stdout.recv_timeout(timeout) {
            Ok(line) => line,
            Err(e) => panic!(
                "{}: no line on stdout within {timeout:?} ({e}); stderr so far:\n{}",
                self.name,
                self.stderr_so_far()
            ),
        }
    }

    pub(crate) fn stderr_so_far(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits for the process to exit, until `deadline`, and collects its output.
    pub(crate) fn wait(&mut self, deadline: Instant) -> Finished {
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Ok(None) => panic!(
                    "{}: still running at the deadline; stderr so far:\n{}",
                    self.name,
                    self.stderr_so_far()
                ),
                Err(e) => panic!("{}: cannot poll: {e}", self.name),
            }
        };
        // The pipes close when the process exits, so the readers end, unless a process it
        // started still holds them: the readers too are waited for until `deadline` only.
        for t in [self.stdout_thread.take(), self.stderr_thread.take()]
            .into_iter()
            .flatten()
        {
            while !t.is_finished() {
                assert!(
                    Instant::now() < deadline,
                    "{}: exited, but its output is still open at the deadline (held by a \
                     process it started?); stderr so far:\n{}",
                    self.name,
                    self.stderr_so_far()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = t.join();
        }
        let mut stdout = std::mem::take(&mut self.seen);
        stdout.extend(self.stdout.try_iter());
        Finished {
            code: status.code(),
            stdout: stdout.join("\n"),
            stderr: self.stderr_so_far(),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Asserts that `f` ended with `code`, showing its output otherwise.
pub(crate) fn assert_exit(name: &str, f: &Finished, code: i32) {
    assert_eq!(
        f.code,
        Some(code),
        "{name}: exit {:?}, want {code}\nstdout:\n{}\nstderr:\n{}",
        f.code,
        f.stdout,
        f.stderr
    );
}
