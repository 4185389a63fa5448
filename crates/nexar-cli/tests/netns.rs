//! A cluster across network namespaces, each a separate "host" with its own address: the
//! seed in the root namespace and one `nexar worker` per namespace, all on a private
//! 10.213.0.0/24 segment that exists only for this test (10.213.1.0/24 for the second).
//!
//! The segment's switch is a bridge inside a namespace of its own, so firewall rules of the
//! root namespace that filter bridged traffic (br_netfilter) cannot get in the way; the
//! root namespace only gets one veth, holding the seed's address. Needs root with the
//! right to create namespaces and links (CAP_SYS_ADMIN, CAP_NET_ADMIN), iproute2, and the
//! segments free; elsewhere it prints why it is skipping.

mod support;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use nexar_cli::checks;
use support::{assert_exit, Finished, Proc};

/// The test's segment; the seed gets `.1`, worker `i` gets `.(i + 2)`.
const SUBNET: &str = "10.213.0";
const WORKERS: usize = 3;
const RUN: Duration = Duration::from_secs(240);

/// Runs `ip` with `args`; returns what it printed, or what it said on stderr when it fails.
fn try_ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `ip` with `args`, which must succeed; returns what it printed.
fn ip(args: &[&str]) -> String {
    try_ip(args).unwrap_or_else(|e| panic!("{e}"))
}

/// Why the test tagged `tag` cannot run here, if it cannot. Being root is not enough: root
/// in a container without CAP_SYS_ADMIN and CAP_NET_ADMIN (docker's default, rootless
/// podman) may not create namespaces or veths, so this tries what [`Segment::create`]
/// does with a throwaway namespace, a veth pair and a bridge, and deletes them again. The
/// test's segment, `subnet`.0/24, must also be free on this host.
fn skip_reason(tag: char, subnet: &str) -> Option<String> {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !root {
        return Some("needs root to create network namespaces".into());
    }
    if let Err(e) = try_ip(&["-V"]) {
        return Some(format!(
            "needs iproute2 (`ip`) to create network namespaces ({e})"
        ));
    }
    // Named like the test's own (see Segment::create), with suffixes it does not use.
    let pid = format!("{}{tag}", std::process::id());
    let (ns, outer, inner, bridge) = (
        format!("nx{pid}t"),
        format!("nx{pid}q"),
        format!("nx{pid}r"),
        format!("nx{pid}w"),
    );
    let made = try_ip(&["netns", "add", &ns]);
    let tried = made
        .clone()
        .and_then(|_| {
            try_ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ])
        })
        .and_then(|_| try_ip(&["link", "set", &inner, "netns", &ns]))
        .and_then(|_| try_ip(&["-n", &ns, "link", "add", &bridge, "type", "bridge"]))
        .and_then(|_| try_ip(&["-n", &ns, "link", "set", &inner, "master", &bridge]));
    // Deleting one end of a veth deletes both; this fails if the pair was never made.
    let _ = try_ip(&["link", "del", &outer]);
    let deleted = made.and_then(|_| try_ip(&["netns", "del", &ns]));
    if let Err(e) = tried {
        return Some(format!(
            "cannot create network namespaces, veths and bridges here, although root \
             (a container without CAP_SYS_ADMIN and CAP_NET_ADMIN?): {e}"
        ));
    }
    if let Err(e) = deleted {
        return Some(format!(
            "created a throwaway network namespace but cannot delete it: {e}"
        ));
    }
    let segment = format!("{subnet}.0/24");
    let taken = try_ip(&["-o", "addr", "show", "to", &segment]).and_then(|addrs| {
        try_ip(&["route", "show", "root", &segment]).map(|routes| addrs + &routes)
    });
    match taken {
        Ok(taken) if taken.trim().is_empty() => None,
        Ok(taken) => Some(format!(
            "{segment}, this test's private segment, is already in use on this host (a \
             leftover of a killed run? then delete its nx* links and namespaces):\n{}",
            taken.trim_end()
        )),
        Err(e) => Some(format!("cannot tell whether {segment} is free: {e}")),
    }
}

/// The namespaces and links of one test run, named after the process id so concurrent
/// runs cannot collide (interface names stay within 15 characters). Dropping it deletes
/// them all, also when the test fails.
struct Segment {
    switch: String,
    hosts: Vec<String>,
    root_link: String,
    ports: Vec<String>,
}

impl Segment {
    /// `tag` keeps the names of concurrently running tests apart; `subnet` (three octets)
    /// must be one no other test uses.
    fn create(tag: char, subnet: &str) -> Segment {
        let pid = format!("{}{tag}", std::process::id());
        let mut seg = Segment {
            switch: format!("nx{pid}s"),
            hosts: (1..=WORKERS).map(|i| format!("nx{pid}n{i}")).collect(),
            root_link: format!("nx{pid}h0"),
            ports: Vec::new(),
        };
        let bridge = format!("nxb{pid}");
        ip(&["netns", "add", &seg.switch]);
        ip(&["-n", &seg.switch, "link", "add", &bridge, "type", "bridge"]);
        ip(&["-n", &seg.switch, "link", "set", &bridge, "up"]);
        ip(&["-n", &seg.switch, "link", "set", "lo", "up"]);
        // The root namespace's port: the seed's address.
        let sw_port = format!("nx{pid}p0");
        ip(&[
            "link",
            "add",
            &seg.root_link,
            "type",
            "veth",
            "peer",
            "name",
            &sw_port,
        ]);
        seg.plug(&sw_port, &bridge);
        ip(&[
            "addr",
            "add",
            &format!("{subnet}.1/24"),
            "dev",
            &seg.root_link,
        ]);
        ip(&["link", "set", &seg.root_link, "up"]);
        for (i, host) in seg.hosts.iter().enumerate() {
            let (sw_port, nic) = (format!("nx{pid}p{}", i + 1), format!("nx{pid}e{}", i + 1));
            ip(&["netns", "add", host]);
            ip(&[
                "link", "add", &nic, "type", "veth", "peer", "name", &sw_port,
            ]);
            seg.plug(&sw_port, &bridge);
            seg.ports.push(sw_port);
            ip(&["link", "set", &nic, "netns", host]);
            let addr = format!("{subnet}.{}/24", i + 2);
            ip(&["-n", host, "addr", "add", &addr, "dev", &nic]);
            ip(&["-n", host, "link", "set", &nic, "up"]);
            ip(&["-n", host, "link", "set", "lo", "up"]);
        }
        seg.pin_neighbours(subnet, &pid);
        seg
    }

    /// Makes every address on the segment resolve statically (permanent ARP entries),
    /// so a cut link tests the runtime, not ARP: a NIC that loses carrier flushes its
    /// learnt neighbours, and one resolution attempt lost in the cut waits a second for
    /// the next, while QUIC's probe timeout keeps doubling; that turned a 300 ms cut into
    /// more than 2 s of silence in one CI run.
    fn pin_neighbours(&self, subnet: &str, pid: &str) {
        // Node 0: the root namespace (the seed's address, .1); node n: worker n (.n+1).
        let in_ns = |n: usize| -> Vec<&str> {
            match n {
                0 => Vec::new(),
                n => vec!["-n", &self.hosts[n - 1]],
            }
        };
        let nics: Vec<String> = (0..=WORKERS)
            .map(|n| match n {
                0 => self.root_link.clone(),
                n => format!("nx{pid}e{n}"),
            })
            .collect();
        let macs: Vec<String> = (0..=WORKERS)
            .map(|n| {
                let shown = ip(&[&in_ns(n)[..], &["-o", "link", "show", "dev", &nics[n]]].concat());
                shown
                    .split_whitespace()
                    .skip_while(|w| *w != "link/ether")
                    .nth(1)
                    .unwrap_or_else(|| panic!("no MAC address in: {shown}"))
                    .to_string()
            })
            .collect();
        for (from, nic) in nics.iter().enumerate() {
            for (to, mac) in macs.iter().enumerate().filter(|&(to, _)| to != from) {
                let addr = format!("{subnet}.{}", to + 1);
                let pin = ["neigh", "replace", &addr, "lladdr", mac, "dev", nic];
                ip(&[&in_ns(from)[..], &pin, &["nud", "permanent"]].concat());
            }
        }
    }

    /// Takes worker `i`'s switch port down (a cable pulled) or up again.
    fn set_link(&self, i: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.switch, "link", "set", &self.ports[i], state]);
    }

    /// Moves `port` into the switch namespace and attaches it to `bridge`.
    fn plug(&self, port: &str, bridge: &str) {
        ip(&["link", "set", port, "netns", &self.switch]);
        ip(&["-n", &self.switch, "link", "set", port, "master", bridge]);
        ip(&["-n", &self.switch, "link", "set", port, "up"]);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veths in it, and with them their peers.
        for ns in self.hosts.iter().chain([&self.switch]) {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.root_link])
            .output();
    }
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn ip_of(addr: &serde_json::Value) -> IpAddr {
    addr.as_str()
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .unwrap_or_else(|| panic!("not an address: {addr}"))
        .ip()
}

#[test]
fn workers_in_separate_network_namespaces_form_a_cluster() {
    if let Some(why) = skip_reason('a', SUBNET) {
        eprintln!("skipping: {why}");
        return;
    }
    let deadline = Instant::now() + RUN;
    let seg = Segment::create('a', SUBNET);

    let seed_listen = format!("{SUBNET}.1:0");
    let mut seed = Proc::spawn(
        "seed",
        support::nexar().args(["seed", "--listen", &seed_listen, "--world", "3", "--json"]),
    );
    let join = seed.line(Duration::from_secs(30));
    assert!(join.starts_with(&format!("nexar://{SUBNET}.1:")), "{join}");
    let mut workers: Vec<Proc> = seg
        .hosts
        .iter()
        .map(|ns| {
            let mut cmd = Command::new("ip");
            support::without_launcher(&mut cmd)
                .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_nexar")])
                .args(["worker", "--join", &join, "--listen", "0.0.0.0:0", "smoke"])
                .arg("--json");
            Proc::spawn(&format!("worker in {ns}"), &mut cmd)
        })
        .collect();

    let want: BTreeSet<IpAddr> = (0..WORKERS)
        .map(|i| {
            format!("{SUBNET}.{}", i + 2)
                .parse()
                .expect("a worker address")
        })
        .collect();
    let mut reported = BTreeSet::new();
    for (w, ns) in workers.iter_mut().zip(&seg.hosts) {
        let out = w.wait(deadline);
        assert_exit(ns, &out, 0);
        let lines = json_lines(&out.stdout);
        // The first line describes the rank, the last sums up; one line per check between.
        assert_eq!(lines.len(), checks().len() + 2, "{ns}:\n{}", out.stdout);
        reported.insert(ip_of(&lines[0]["addr"]));
        for line in &lines[1..] {
            assert_eq!(line["ok"], true, "{ns}: {line}");
        }
    }
    assert_eq!(
        reported, want,
        "each worker reports its own namespace's address"
    );

    let out = seed.wait(deadline);
    assert_exit("seed", &out, 0);
    let summary: serde_json::Value =
        serde_json::from_str(out.stdout.trim()).expect("the seed's summary is one JSON line");
    assert_eq!(summary["ok"], true, "{summary}");
    let seen: BTreeSet<IpAddr> = summary["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| ip_of(&r["addr"]))
        .collect();
    assert_eq!(seen, want, "the seed saw each worker at its own address");
    drop(seg);
}

/// Starts a seed on `subnet`.1 and a `soak` worker in each namespace; returns them once
/// every worker has joined and reported progress (its loop is running, 500 iterations in:
/// a fault from then on hits the loop, `iters` being many more).
fn soak_cluster(seg: &Segment, subnet: &str, iters: &str, deadline: Instant) -> (Proc, Vec<Proc>) {
    let seed_listen = format!("{subnet}.1:0");
    let mut seed = Proc::spawn(
        "seed",
        support::nexar().args(["seed", "--listen", &seed_listen, "--world", "3"]),
    );
    let join = seed.line(Duration::from_secs(30));
    let workers: Vec<Proc> = seg
        .hosts
        .iter()
        .map(|ns| {
            let mut cmd = Command::new("ip");
            support::without_launcher(&mut cmd)
                .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_nexar")])
                .args(["worker", "--join", &join, "--listen", "0.0.0.0:0"])
                // The soak's progress events, on stderr.
                .args(["--log", "warn,nexar_cli::soak=info", "soak"])
                .args(["--iters", iters, "--elems", "128"]);
            Proc::spawn(&format!("worker in {ns}"), &mut cmd)
        })
        .collect();
    while !workers
        .iter()
        .all(|w| !progress(&w.stderr_so_far()).is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "the workers did not all join and start their loops"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    (seed, workers)
}

/// The soak's progress events in a worker's `stderr` (see `nexar_cli::soak_rank`): for
/// each, the longest all-reduce since the one before.
fn progress(stderr: &str) -> Vec<Duration> {
    const LONGEST: &str = "; longest all-reduce since the last report: ";
    stderr
        .lines()
        .filter(|l| !l.contains(" lost rank "))
        .filter_map(|l| l.split_once(LONGEST))
        .map(|(_, rest)| {
            let ms = rest.strip_suffix(" ms").unwrap_or(rest);
            let ms = ms
                .parse()
                .unwrap_or_else(|e| panic!("no milliseconds ({e}) in a progress line: {rest}"));
            Duration::from_millis(ms)
        })
        .collect()
}

/// The iterations at which a worker's soak lost a peer, from its `stderr`.
fn losses(stderr: &str) -> Vec<u64> {
    stderr
        .lines()
        .filter_map(|l| l.split_once(" at iteration "))
        .filter(|(head, _)| head.contains(" lost rank "))
        .map(|(_, rest)| {
            let n = rest.split(' ').next().unwrap_or_default();
            n.parse()
                .unwrap_or_else(|e| panic!("no iteration number ({e}) in: {rest}"))
        })
        .collect()
}

/// A link cut well under the heartbeat timeout (2 s in the soak job) is carried
/// through: nobody is declared dead. "Well under": the silence a peer sees is the cut
/// plus QUIC's loss recovery after it, whose probe timeout doubles with every probe lost
/// during the cut, so it can last about as long again as the cut. Neighbours are pinned
/// ([`Segment::pin_neighbours`]): with learnt ARP entries, a 500 ms and then a 300 ms
/// cut each failed this test once in CI (a worker heard nothing for 2.09 s), the NIC
/// having flushed its neighbours with the carrier. A longer cut gets the cut-off worker
/// declared dead, and the two that can still reach each other finish on their own; the
/// cut-off worker, a minority of one, fails its recovery.
#[test]
fn link_cuts_short_ones_carried_through_long_ones_declare_the_peer_dead() {
    let subnet = "10.213.1";
    if let Some(why) = skip_reason('b', subnet) {
        eprintln!("skipping: {why}");
        return;
    }
    let deadline = Instant::now() + RUN;
    let seg = Segment::create('b', subnet);

    // Short cut: 300 ms on worker 2's link, once the loops run. (The sleep is the cut's
    // length, not a wait for something.)
    let cut = Duration::from_millis(300);
    let (mut seed, mut workers) = soak_cluster(&seg, subnet, "6000", deadline);
    seg.set_link(2, false);
    std::thread::sleep(cut);
    seg.set_link(2, true);
    let outs: Vec<Finished> = workers.iter_mut().map(|w| w.wait(deadline)).collect();
    // Every worker's output goes with a failure: the one that fails is seldom the one
    // that declared a peer lost, and that one's log says why (the silence it saw).
    let all: String = outs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            format!(
                "--- worker {i}: exit {:?}\nstdout:\n{}\nstderr:\n{}\n",
                o.code, o.stdout, o.stderr
            )
        })
        .collect();
    for (i, out) in outs.iter().enumerate() {
        assert!(
            out.code == Some(0)
                && out
                    .stdout
                    .contains("finished 6000 iterations; world 3 after 0 recoveries"),
            "worker {i} after a short cut; every worker:\n{all}"
        );
    }
    // The cut hit the running loop: every all-reduce needs worker 2, so the one under way
    // when the link went down waited for it to come back. (6000 is a multiple of the
    // progress interval: the last event covers the iterations up to the end.)
    let stalled = outs
        .iter()
        .flat_map(|o| progress(&o.stderr))
        .max()
        .unwrap_or_default();
    assert!(
        stalled >= cut * 9 / 10,
        "no all-reduce waited out the {cut:?} cut (longest {stalled:?}): it missed the \
         loop; every worker:\n{all}"
    );
    assert_exit("seed", &seed.wait(deadline), 0);

    // Long cut: 5 s, beyond the heartbeat timeout. Workers 0 and 1 go on as a pair.
    let (mut seed, mut workers) = soak_cluster(&seg, subnet, "20000", deadline);
    seg.set_link(2, false);
    std::thread::sleep(Duration::from_secs(5));
    seg.set_link(2, true);
    for (i, w) in workers.iter_mut().enumerate().take(2) {
        let out = w.wait(deadline);
        assert_exit(&format!("worker {i}"), &out, 0);
        assert!(
            out.stdout
                .contains("finished 20000 iterations; world 2 after 1 recoveries"),
            "worker {i} after a long cut:\n{}\n{}",
            out.stdout,
            out.stderr
        );
        // The cut hit the running loop: the worker lost its peer mid-loop.
        let lost = losses(&out.stderr);
        assert!(
            lost.len() == 1 && lost[0] < 20000,
            "worker {i}: want one lost peer before iteration 20000, got {lost:?}:\n{}",
            out.stderr
        );
    }
    // The cut-off worker lost everyone: alone it is not a quorum of three, so its
    // recovery fails rather than carrying on as a cluster of one.
    let out = workers[2].wait(deadline);
    assert_exit("cut-off worker", &out, 1);
    assert!(
        out.stdout.contains("not a quorum"),
        "cut-off worker:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    assert_exit("seed", &seed.wait(deadline), 1);
    drop(seg);
}
