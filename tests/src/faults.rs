//! A seeded, fault-injecting UDP relay: QUIC runs over UDP, so a relay placed on one link
//! can drop, delay, duplicate and reorder datagrams deterministically, without root or
//! netem. Traffic goes only between loopback sockets.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

/// What the relay does to each datagram, in each direction.
#[derive(Clone, Copy, Debug)]
pub struct Faults {
    /// Probability of dropping a datagram.
    pub loss: f64,
    /// Fixed one-way delay.
    pub delay: Duration,
    /// Extra random delay in `0..jitter` (datagrams overtake each other: reordering).
    pub jitter: Duration,
    /// Probability of sending a datagram twice.
    pub duplicate: f64,
    /// RNG seed.
    pub seed: u64,
}

impl Faults {
    /// A relay that passes every datagram on at once, unchanged (until cut: see
    /// [`FaultyLink::set_cut`]).
    pub fn clean(seed: u64) -> Faults {
        Faults {
            loss: 0.0,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            duplicate: 0.0,
            seed,
        }
    }
}

/// Counters of what the relay did.
#[derive(Debug, Default)]
pub struct LinkStats {
    /// Datagrams received from either side.
    pub seen: AtomicU64,
    /// Datagrams dropped.
    pub dropped: AtomicU64,
    /// Extra copies sent.
    pub duplicated: AtomicU64,
}

/// A running relay; dropping it stops it.
#[derive(Debug)]
pub struct FaultyLink {
    addr: SocketAddr,
    stats: Arc<LinkStats>,
    cut: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl FaultyLink {
    /// Starts a relay on 127.0.0.1 that forwards to `target` (and replies back to whoever
    /// last sent to it). Must be called inside a tokio runtime.
    pub fn start(target: SocketAddr, faults: Faults) -> std::io::Result<FaultyLink> {
        let front = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let back = std::net::UdpSocket::bind("127.0.0.1:0")?;
        front.set_nonblocking(true)?;
        back.set_nonblocking(true)?;
        let addr = front.local_addr()?;
        let front = Arc::new(UdpSocket::from_std(front)?);
        let back = Arc::new(UdpSocket::from_std(back)?);
        let stats = Arc::new(LinkStats::default());
        let st = stats.clone();
        let cut = Arc::new(AtomicBool::new(false));
        let is_cut = cut.clone();
        let task = tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(faults.seed);
            let mut client: Option<SocketAddr> = None;
            let mut a = vec![0u8; 65_536];
            let mut b = vec![0u8; 65_536];
            loop {
                let (data, out, to) = tokio::select! {
                    r = front.recv_from(&mut a) => match r {
                        Ok((n, from)) => {
                            client = Some(from);
                            (a[..n].to_vec(), back.clone(), target)
                        }
                        Err(_) => continue,
                    },
                    r = back.recv_from(&mut b) => match r {
                        Ok((n, _)) => match client {
                            Some(c) => (b[..n].to_vec(), front.clone(), c),
                            None => continue,
                        },
                        Err(_) => continue,
                    },
                };
                st.seen.fetch_add(1, Ordering::Relaxed);
                if is_cut.load(Ordering::Relaxed) || rng.gen_bool(faults.loss) {
                    st.dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let copies = if rng.gen_bool(faults.duplicate) {
                    st.duplicated.fetch_add(1, Ordering::Relaxed);
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    let jitter = faults.jitter.mul_f64(rng.gen::<f64>());
                    let wait = faults.delay + jitter;
                    let (out, data) = (out.clone(), data.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(wait).await;
                        let _ = out.send_to(&data, to).await;
                    });
                }
            }
        });
        Ok(FaultyLink {
            addr,
            stats,
            cut,
            task,
        })
    }

    /// The address to dial instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the link (every datagram in both directions is dropped) or restores it.
    pub fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::Relaxed);
    }

    /// What the relay has done so far.
    pub fn stats(&self) -> &LinkStats {
        &self.stats
    }
}

impl Drop for FaultyLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A local cluster of `world` ranks on 127.0.0.1 in which every connection that rank `a`
/// dials to rank `b` with `relayed(a, b)` goes through its own [`FaultyLink`] with
/// `faults` (its seed offset by the dialling rank, so the two directions differ).
/// Returns the cluster and the relays, in the order they were started.
pub async fn relayed_cluster(
    world: usize,
    config: nexar_actors::NodeConfig,
    faults: Faults,
    relayed: impl Fn(usize, usize) -> bool,
) -> nexar_actors::Result<(nexar_actors::Cluster, Vec<FaultyLink>)> {
    let links = std::sync::Mutex::new(Vec::new());
    let cluster = nexar_actors::Cluster::local_with_dialer(
        world,
        config,
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        |a, b, addr| {
            if !relayed(a, b) {
                return addr;
            }
            let mut f = faults;
            f.seed += a as u64;
            let link = FaultyLink::start(addr, f).expect("start a fault-injecting relay");
            let relay = link.addr();
            links.lock().expect("relay list").push(link);
            relay
        },
    )
    .await?;
    let links = links.into_inner().expect("relay list");
    Ok((cluster, links))
}
