//! Launch conventions: nexar's own variables, torchrun's and SLURM's.
//!
//! | variable | meaning |
//! |---|---|
//! | `NEXAR_JOIN` | the join string printed by `nexar seed` (seed address, secret, fingerprint) |
//! | `NEXAR_SECRET` / `NEXAR_SECRET_FILE` | the secret (64 hex digits), when `NEXAR_JOIN` is not set |
//! | `NEXAR_SEED_FINGERPRINT` | the seed certificate's SHA-256 (64 hex digits), when `NEXAR_JOIN` is not set |
//! | `NEXAR_SEED` or `MASTER_ADDR` + `MASTER_PORT` | the seed address, when `NEXAR_JOIN` is not set |
//! | `NEXAR_RANK`, else `RANK` (torchrun), else `SLURM_PROCID` | the rank to ask for |
//! | `NEXAR_WORLD_SIZE`, else `WORLD_SIZE`, else `SLURM_NTASKS` | [`EnvJoin::expected_world`], checked against the world the node forms with by [`Node::from_env`](crate::Node::from_env) and `nexar worker` ([`EnvJoin::world_mismatch`]; not for a node admitted to a running elastic cluster, nor by `nexar worker ... elastic`) |
//! | `NEXAR_LISTEN` | mesh listen address (default `0.0.0.0:0`) |
//! | `NEXAR_ADVERTISE` | mesh address peers dial (default: as the seed sees this host) |

use std::net::{SocketAddr, ToSocketAddrs};

use super::proto::{JoinString, Secret};
use super::{BootstrapError, JoinOptions};

/// What the environment says: join options plus the world size the launcher expects.
#[derive(Clone, Debug)]
pub struct EnvJoin {
    /// Options for [`Node::join`](crate::Node::join).
    pub options: JoinOptions,
    /// The world size the launcher announced, if any.
    pub expected_world: Option<usize>,
    /// The variable the rank to ask for came from (`NEXAR_RANK`, `RANK` or
    /// `SLURM_PROCID`), if any: for errors that name it.
    pub rank_from: Option<&'static str>,
    /// The variable the expected world size came from, if any.
    pub world_from: Option<&'static str>,
}

impl EnvJoin {
    /// What is wrong when the launcher announced a world size other than `world`, the
    /// size of the cluster this node joined ([`world_mismatch`]).
    pub fn world_mismatch(&self, world: usize) -> Option<String> {
        world_mismatch(self.expected_world.zip(self.world_from), world)
    }
}

/// What is wrong when a launcher announced (in variable `var`) a world size `expected`
/// other than `world`, the size of the cluster a node joined; `None` when it agrees or
/// said nothing. (Not for an elastic job that a node joins while it runs: it gets
/// whatever size the resize point that admits it makes.)
pub fn world_mismatch(expected: Option<(usize, &str)>, world: usize) -> Option<String> {
    let (expected, var) = expected?;
    (expected != world).then(|| {
        format!(
            "the launcher says ({var}) the world has {expected} ranks, but the seed's cluster \
             has {world}; start the seed with --world {expected} or fix the launcher"
        )
    })
}

fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, BootstrapError>
where
    T::Err: std::fmt::Display,
{
    v.trim()
        .parse()
        .map_err(|e| BootstrapError::Environment(format!("{name}={v:?}: {e}")))
}

/// Reads the launcher variables through `get` (use `|k| std::env::var(k).ok()`).
pub fn from_env_vars(get: impl Fn(&str) -> Option<String>) -> Result<EnvJoin, BootstrapError> {
    let join = join_from_env(&get)?;
    with_env_overrides(join, get)
}

/// Join options for a join string given otherwise (`nexar worker --join`), with what the
/// launcher variables say of this worker: the rank to ask for, the world size expected,
/// the listen and advertised addresses (the table above, all but the join string's).
pub fn with_env_overrides(
    join: JoinString,
    get: impl Fn(&str) -> Option<String>,
) -> Result<EnvJoin, BootstrapError> {
    let mut options = JoinOptions::new(join);
    let first = |names: &[&'static str]| names.iter().find_map(|n| get(n).map(|v| (*n, v)));
    let rank = first(&["NEXAR_RANK", "RANK", "SLURM_PROCID"]);
    if let Some((name, v)) = &rank {
        options.rank = Some(parse(name, v)?);
    }
    let world = first(&["NEXAR_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS"]);
    let expected_world = match &world {
        Some((name, v)) => Some(parse(name, v)?),
        None => None,
    };
    if let Some(v) = get("NEXAR_LISTEN") {
        options.listen = parse("NEXAR_LISTEN", &v)?;
    }
    if let Some(v) = get("NEXAR_ADVERTISE") {
        options.advertise = Some(parse("NEXAR_ADVERTISE", &v)?);
    }
    Ok(EnvJoin {
        options,
        expected_world,
        rank_from: rank.map(|(name, _)| name),
        world_from: world.map(|(name, _)| name),
    })
}

/// The seed's address among those its name resolves to: the first IPv4 one, else the
/// first. A seed mostly listens on IPv4 (`0.0.0.0:PORT`, as in the examples) or on a
/// dual-stack IPv6 socket, which takes IPv4 too, while a resolver may well put `::1`
/// first for `localhost`.
fn seed_of(addrs: impl Iterator<Item = SocketAddr>) -> Option<SocketAddr> {
    let mut first = None;
    for a in addrs {
        if a.is_ipv4() {
            return Some(a);
        }
        first = first.or(Some(a));
    }
    first
}

/// The join string: `NEXAR_JOIN`, else put together from the seed address, the secret and
/// the seed's fingerprint.
fn join_from_env(get: &impl Fn(&str) -> Option<String>) -> Result<JoinString, BootstrapError> {
    Ok(match get("NEXAR_JOIN") {
        Some(j) => j.parse::<JoinString>()?,
        None => {
            let seed: SocketAddr = match (get("NEXAR_SEED"), get("MASTER_ADDR"), get("MASTER_PORT")) {
                (Some(s), _, _) => parse("NEXAR_SEED", &s)?,
                (None, Some(host), Some(port)) => {
                    let port: u16 = parse("MASTER_PORT", &port)?;
                    let addrs = (host.as_str(), port)
                        .to_socket_addrs()
                        .map_err(|e| BootstrapError::Environment(format!("MASTER_ADDR={host:?}: {e}")))?;
                    seed_of(addrs)
                        .ok_or_else(|| BootstrapError::Environment(format!("MASTER_ADDR={host:?} resolves to nothing")))?
                }
                _ => {
                    return Err(BootstrapError::Environment(
                        "set NEXAR_JOIN (from `nexar seed`), or NEXAR_SEED / MASTER_ADDR+MASTER_PORT with NEXAR_SECRET and NEXAR_SEED_FINGERPRINT".into(),
                    ))
                }
            };
            let secret = match (get("NEXAR_SECRET"), get("NEXAR_SECRET_FILE")) {
                (Some(s), _) => Secret::from_hex(&s)?,
                (None, Some(path)) => {
                    let text = std::fs::read_to_string(&path).map_err(|e| {
                        BootstrapError::Environment(format!("NEXAR_SECRET_FILE={path:?}: {e}"))
                    })?;
                    Secret::from_hex(&text)?
                }
                (None, None) => {
                    return Err(BootstrapError::Environment(
                        "NEXAR_SECRET or NEXAR_SECRET_FILE is required".into(),
                    ))
                }
            };
            let fp = get("NEXAR_SEED_FINGERPRINT").ok_or_else(|| {
                BootstrapError::Environment("NEXAR_SEED_FINGERPRINT is required".into())
            })?;
            let bytes = hex::decode(fp.trim())
                .map_err(|e| BootstrapError::Environment(format!("NEXAR_SEED_FINGERPRINT: {e}")))?;
            let fingerprint = bytes.try_into().map_err(|_| {
                BootstrapError::Environment("NEXAR_SEED_FINGERPRINT must be 64 hex digits".into())
            })?;
            JoinString {
                seed,
                secret,
                fingerprint,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn nexar_join_string_and_rank() {
        let j = JoinString {
            seed: "127.0.0.1:7000".parse().unwrap(),
            secret: Secret([1; 32]),
            fingerprint: [2; 32],
        };
        let e = from_env_vars(env(&[
            ("NEXAR_JOIN", &j.to_string()),
            ("NEXAR_RANK", "3"),
            ("NEXAR_LISTEN", "0.0.0.0:9000"),
        ]))
        .unwrap();
        assert_eq!(e.options.join, j);
        assert_eq!(e.options.rank, Some(3));
        assert_eq!(e.options.listen, "0.0.0.0:9000".parse().unwrap());
    }

    #[test]
    fn torchrun_convention() {
        let secret = "ab".repeat(32);
        let fp = "cd".repeat(32);
        let e = from_env_vars(env(&[
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("NEXAR_SECRET", &secret),
            ("NEXAR_SEED_FINGERPRINT", &fp),
        ]))
        .unwrap();
        assert_eq!(e.options.join.seed, "127.0.0.1:29500".parse().unwrap());
        assert_eq!(e.options.rank, Some(2));
        assert_eq!(e.expected_world, Some(4));
    }

    #[test]
    fn slurm_convention_and_missing_pieces() {
        let j = JoinString {
            seed: "127.0.0.1:7000".parse().unwrap(),
            secret: Secret([1; 32]),
            fingerprint: [2; 32],
        };
        let e = from_env_vars(env(&[
            ("NEXAR_JOIN", &j.to_string()),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
        ]))
        .unwrap();
        assert_eq!(e.options.rank, Some(5));
        assert_eq!(e.expected_world, Some(8));
        assert!(matches!(
            from_env_vars(env(&[])),
            Err(BootstrapError::Environment(_))
        ));
        assert!(matches!(
            from_env_vars(env(&[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")])),
            Err(BootstrapError::Environment(_))
        ));
        assert!(from_env_vars(env(&[("NEXAR_JOIN", &j.to_string()), ("RANK", "x")])).is_err());
    }

    #[test]
    fn a_join_string_given_otherwise_keeps_the_launchers_rank_world_and_addresses() {
        let j = JoinString {
            seed: "127.0.0.1:7000".parse().unwrap(),
            secret: Secret([1; 32]),
            fingerprint: [2; 32],
        };
        let other = JoinString {
            seed: "127.0.0.2:7000".parse().unwrap(),
            ..j.clone()
        };
        let e = with_env_overrides(
            j.clone(),
            env(&[
                ("NEXAR_JOIN", &other.to_string()),
                ("RANK", "3"),
                ("WORLD_SIZE", "4"),
                ("NEXAR_LISTEN", "0.0.0.0:9000"),
                ("NEXAR_ADVERTISE", "10.0.0.7:9000"),
            ]),
        )
        .unwrap();
        assert_eq!(
            e.options.join, j,
            "the given join string wins over NEXAR_JOIN"
        );
        assert_eq!(e.options.rank, Some(3));
        assert_eq!(e.expected_world, Some(4));
        assert_eq!(e.options.listen, "0.0.0.0:9000".parse().unwrap());
        assert_eq!(e.options.advertise, Some("10.0.0.7:9000".parse().unwrap()));
        let bare = with_env_overrides(j.clone(), env(&[])).unwrap();
        assert_eq!((bare.options.rank, bare.expected_world), (None, None));
        assert_eq!(
            (e.rank_from, e.world_from),
            (Some("RANK"), Some("WORLD_SIZE"))
        );
        assert!(with_env_overrides(j, env(&[("SLURM_PROCID", "-1")])).is_err());
    }

    /// A name that resolves to IPv6 and IPv4 addresses gives the IPv4 one (the family a
    /// seed mostly takes); only IPv6 ones give the first.
    #[test]
    fn a_seed_name_resolving_to_both_families_gives_its_ipv4_address() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        let both = [addr("[::1]:29500"), addr("127.0.0.1:29500")];
        assert_eq!(
            super::seed_of(both.into_iter()),
            Some(addr("127.0.0.1:29500"))
        );
        let six = [addr("[::1]:29500"), addr("[fd00::1]:29500")];
        assert_eq!(super::seed_of(six.into_iter()), Some(addr("[::1]:29500")));
        assert_eq!(super::seed_of(std::iter::empty()), None);
    }
}
