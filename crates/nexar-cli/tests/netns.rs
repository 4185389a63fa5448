//! A cluster across network namespaces, each a separate "host" with its own address: the
//! seed in the root namespace and one `nexar worker` per namespace, all on a private
//! 10.213.0.0/24 segment that exists only for this test.
//!
//! The segment's switch is a bridge inside a namespace of its own, so firewall rules of the
//! root namespace that filter bridged traffic (br_netfilter) cannot get in the way; the
//! root namespace only gets one veth, holding the seed's address. Needs root and iproute2;
//! elsewhere it prints that it is skipping.

mod support;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use nexar_cli::checks;
use support::{assert_exit, Proc};

/// The test's segment; the seed gets `.1`, worker `i` gets `.(i + 2)`.
const SUBNET: &str = "10.213.0";
const WORKERS: usize = 3;
const RUN: Duration = Duration::from_secs(240);

/// Runs `ip ARGS`, panicking with its stderr when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn can_run() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let has_ip = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    root && has_ip
}

/// The namespaces and links of one test run, named after the process id so concurrent
/// runs cannot collide (interface names stay within 15 characters). Dropping it deletes
/// them all, also when the test fails.
struct Segment {
    switch: String,
    hosts: Vec<String>,
    root_link: String,
}

impl Segment {
    fn create() -> Segment {
        let pid = std::process::id();
        let seg = Segment {
            switch: format!("nx{pid}s"),
            hosts: (1..=WORKERS).map(|i| format!("nx{pid}n{i}")).collect(),
            root_link: format!("nx{pid}h0"),
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
            &format!("{SUBNET}.1/24"),
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
            ip(&["link", "set", &nic, "netns", host]);
            let addr = format!("{SUBNET}.{}/24", i + 2);
            ip(&["-n", host, "addr", "add", &addr, "dev", &nic]);
            ip(&["-n", host, "link", "set", &nic, "up"]);
            ip(&["-n", host, "link", "set", "lo", "up"]);
        }
        seg
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
    if !can_run() {
        eprintln!("skipping: needs root and iproute2 (`ip`) to create network namespaces");
        return;
    }
    let taken = Command::new("ip")
        .args(["-o", "addr", "show", "to", &format!("{SUBNET}.0/24")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    assert!(
        taken.trim().is_empty(),
        "{SUBNET}.0/24 is already in use on this host, so this test cannot create its \
         private segment there; remove it (or a leftover nx* namespace) first:\n{taken}"
    );
    let deadline = Instant::now() + RUN;
    let seg = Segment::create();

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
            cmd.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_nexar")])
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
