//! Which `hostPort`s a Pod may be given, and which it never may.
//!
//! With a Pod network a `hostPort` becomes a DNAT rule on the host (the
//! `portmap` plugin's): every connection to that port on the host's
//! addresses goes to the Pod, whatever served it before (vkd's kubelet port,
//! etcd, sshd), so a Pod could take over a host service's traffic. Four
//! checks stand in the way, in this order:
//!
//! 1. **The node policy** (`hostPorts.allowed` in the config): as Pod
//!    Security's baseline asks, a node gives out only the ports it names,
//!    none by default.
//! 2. **The host's reservations** ([`Reservations`]): every vkd on the host
//!    records the ports it serves (kubelet API, admin server) in one
//!    root-owned directory at start and never takes them back, so a port is
//!    refused while its vkd restarts too, when nothing listens on it.
//! 3. **What the host serves now** (`/proc/net/{tcp,tcp6,udp,udp6}` of the
//!    network namespace the plugins run in: TCP sockets in LISTEN,
//!    unconnected UDP sockets), for services that are not vkd.
//! 4. **What Pods hold**: the recorded networks (`network.json`) of every
//!    node on the host that registered its Pods there, this one included.
//!
//! The last three are checked under the reservations' lock (a `flock`
//! shared by every vkd on the host), and again right before the plugins
//! make the rule: a create checks and records its ports under the lock, so
//! no two nodes give out one port, whenever each looked.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vkd_provider::HostPort;

use crate::config::PortRange;

/// The reason a Pod gets when it asks for a port the node uses.
pub const HOST_PORT_IN_USE: &str = "HostPortInUse";
/// The reason a Pod gets for a port the node policy does not give out, or
/// one a vkd on the host serves.
pub const HOST_PORT_NOT_ALLOWED: &str = "HostPortNotAllowed";
/// Where every vkd on the host reserves its ports, unless
/// `--host-port-reservations` says otherwise. Not under /run: a reboot must
/// not free the ports of a vkd that has not started again yet.
pub const DEFAULT_RESERVATIONS: &str = "/var/lib/vkd/host-ports";

/// The lock file, in the reservations directory.
const LOCK: &str = ".lock";
/// Where nodes that give out hostPorts register their Pods directory.
const NODES: &str = "nodes";
/// How long a check waits for another vkd's: it holds the lock only to
/// read and record, never while a plugin runs.
const LOCK_WAIT: Duration = Duration::from_secs(10);
/// The most read of one reservation or registration: a line.
const ENTRY_MAX: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum HostPortError {
    #[error("reading the host's sockets from {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("hostPort {port}/{protocol} is in use on this node: {by}")]
    InUse {
        port: u16,
        protocol: String,
        by: String,
    },
    #[error("hostPort {port}/{protocol} is not allowed on node {node}: {why}")]
    NotAllowed {
        port: u16,
        protocol: String,
        node: String,
        why: String,
    },
    #[error(
        "hostPort {port}/{protocol} is reserved on this host for {by} ({path}): no Pod is given \
         a port a vkd on the host serves, whether or not it listens now"
    )]
    Reserved {
        port: u16,
        protocol: String,
        by: String,
        path: PathBuf,
    },
    #[error("the host's port reservations {path}: {message}")]
    Reservations { path: PathBuf, message: String },
}

impl HostPortError {
    /// The reason the Pod fails with, for a refusal of what it asks; `None`
    /// for a fault of the host's (retried, never the Pod's).
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Self::InUse { .. } => Some(HOST_PORT_IN_USE),
            Self::NotAllowed { .. } | Self::Reserved { .. } => Some(HOST_PORT_NOT_ALLOWED),
            Self::Read { .. } | Self::Reservations { .. } => None,
        }
    }
}

/// Refuses the first of `ports` that the node policy `allowed` does not
/// name (all of them when it names none).
pub fn check_allowed(
    ports: &[HostPort],
    allowed: &[PortRange],
    node: &str,
) -> Result<(), HostPortError> {
    let Some(p) = ports
        .iter()
        .find(|p| !allowed.iter().any(|r| r.contains(p.host_port)))
    else {
        return Ok(());
    };
    let why = if allowed.is_empty() {
        "the node allows no hostPort (a hostPort is a port of the host, taken in front of \
         whatever serves it there, as Pod Security's baseline warns); hostPorts.allowed in the \
         process provider config names the ports its Pods may be given"
            .to_owned()
    } else {
        let list: Vec<String> = allowed.iter().map(ToString::to_string).collect();
        format!(
            "the node gives out only {} (hostPorts.allowed in the process provider config)",
            list.join(", ")
        )
    };
    Err(HostPortError::NotAllowed {
        port: p.host_port,
        protocol: p.protocol.to_ascii_uppercase(),
        node: node.to_owned(),
        why,
    })
}

/// A port a vkd on the host serves, as its reservation says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserved {
    pub port: u16,
    /// Who serves it (the reservation's first line).
    pub by: String,
    pub path: PathBuf,
}

/// Refuses the first of `ports` that is reserved, on any protocol and
/// address: vkd's ports are TCP, but a reservation is the whole port.
pub fn check_reserved(ports: &[HostPort], reserved: &[Reserved]) -> Result<(), HostPortError> {
    for p in ports {
        if let Some(r) = reserved.iter().find(|r| r.port == p.host_port) {
            return Err(HostPortError::Reserved {
                port: p.host_port,
                protocol: p.protocol.to_ascii_uppercase(),
                by: r.by.clone(),
                path: r.path.clone(),
            });
        }
    }
    Ok(())
}

/// The host-wide record of vkd's own ports and of the nodes that give out
/// hostPorts: a directory every vkd on the host shares, root's and writable
/// by no one else (a reservation someone else could remove would protect
/// nothing). `<dir>/<port>` holds who serves the port; `<dir>/nodes/<id>`
/// holds a node's Pods directory; `<dir>/.lock` orders every check.
/// Nothing here is ever removed by vkd: a reservation outlives its vkd, so
/// that its port stays its own while it restarts (an admin removes the file
/// of a port no vkd serves any more).
#[derive(Clone, Debug)]
pub struct Reservations {
    dir: PathBuf,
}

/// The host-wide lock, held while a port is checked and recorded.
#[derive(Debug)]
pub struct HostLock {
    file: std::fs::File,
}

impl Drop for HostLock {
    fn drop(&mut self) {
        // Closing the file releases it too; said plainly all the same.
        let _ = rustix::fs::flock(&self.file, rustix::fs::FlockOperation::Unlock);
    }
}

impl Reservations {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn fault(&self, message: impl std::fmt::Display) -> HostPortError {
        HostPortError::Reservations {
            path: self.dir.clone(),
            message: message.to_string(),
        }
    }

    /// Makes `dir` (0755) where missing, and checks that no one but root
    /// (or vkd's own user) could change it or a directory above it.
    fn make_dir(&self, dir: &Path) -> Result<(), HostPortError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| self.fault(format!("making {}: {e}", dir.display())))?;
        self.check_secure(dir)
    }

    /// Every directory down to `dir` is root's (or vkd's user's) and
    /// writable by no one else; those above `dir` may be sticky (as /tmp).
    fn check_secure(&self, dir: &Path) -> Result<(), HostPortError> {
        use std::os::unix::fs::MetadataExt;
        let me = rustix::process::geteuid().as_raw();
        let abs = std::path::absolute(dir).map_err(|e| self.fault(e))?;
        let mut p = PathBuf::new();
        let last = abs.components().count();
        for (i, c) in abs.components().enumerate() {
            p.push(c);
            let m =
                std::fs::metadata(&p).map_err(|e| self.fault(format!("{}: {e}", p.display())))?;
            let mode = m.mode() & 0o7777;
            let others_write = mode & 0o002 != 0 || (mode & 0o020 != 0 && m.gid() != 0);
            let sticky = mode & 0o1000 != 0 && i + 1 < last;
            if (m.uid() != 0 && m.uid() != me) || (others_write && !sticky) {
                return Err(self.fault(format!(
                    "{} (owner uid {}, mode {mode:o}) could be changed by another user, who could \
                     then free a vkd's port: it must be root's and writable by no one else",
                    p.display(),
                    m.uid()
                )));
            }
        }
        Ok(())
    }

    /// Records that this vkd serves `ports` (each with what serves it), for
    /// good: every hostPort check on the host refuses them from now on,
    /// whether or not anything listens.
    pub fn reserve(&self, ports: &BTreeMap<u16, String>, node: &str) -> Result<(), HostPortError> {
        // Under the host's lock, as every hostPort is given out: a port is
        // either reserved before a Pod asks, or found held by one here.
        let _lock = self.lock()?;
        for (port, what) in ports {
            let path = self.dir.join(port.to_string());
            let line = format!("{what}, vkd of node {node}\n");
            crate::sandbox::write_atomic(&path, line.as_bytes(), 0o644)
                .map_err(|e| self.fault(format!("{}: {e}", path.display())))?;
        }
        // A Pod given one of them before this vkd first reserved it would
        // answer its traffic: said, never served silently behind it.
        let pods = held_by_pods(&self.pods_dirs()?, Path::new(""));
        for (pod, held) in &pods {
            if let Some(p) = held.iter().find(|p| ports.contains_key(&p.host_port)) {
                return Err(self.fault(format!(
                    "port {} that vkd serves is the hostPort of {pod}: a connection to it \
                     would reach that Pod; delete the Pod (or move vkd's port) and start again",
                    p.host_port
                )));
            }
        }
        Ok(())
    }

    /// The reserved ports; none when no vkd has reserved any yet.
    pub fn reserved(&self) -> Result<Vec<Reserved>, HostPortError> {
        let Some(entries) = self.entries(&self.dir)? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (name, path) in entries {
            let Some(port) = name.parse::<u16>().ok().filter(|p| *p > 0) else {
                continue;
            };
            // One that cannot be read still reserves its port.
            let by = read_line(&path)
                .ok()
                .filter(|l| !l.is_empty())
                .unwrap_or_else(|| "a vkd on this host".to_owned());
            out.push(Reserved { port, by, path });
        }
        Ok(out)
    }

    /// Registers `pods`, a node's Pods directory (absolute), so that every
    /// node on the host sees the hostPorts its Pods hold.
    pub fn register_pods(&self, pods: &Path) -> Result<(), HostPortError> {
        let nodes = self.dir.join(NODES);
        self.make_dir(&nodes)?;
        let text = pods
            .to_str()
            .filter(|t| pods.is_absolute() && !t.contains('\n'));
        let Some(text) = text else {
            return Err(self.fault(format!("{} is no absolute UTF-8 path", pods.display())));
        };
        let path = nodes.join(format!("{:016x}", fnv1a(text.as_bytes())));
        crate::sandbox::write_atomic(&path, format!("{text}\n").as_bytes(), 0o644)
            .map_err(|e| self.fault(format!("{}: {e}", path.display())))
    }

    /// The Pods directories nodes on the host registered.
    pub fn pods_dirs(&self) -> Result<Vec<PathBuf>, HostPortError> {
        let Some(entries) = self.entries(&self.dir.join(NODES))? else {
            return Ok(Vec::new());
        };
        Ok(entries
            .into_iter()
            .filter_map(|(_, path)| read_line(&path).ok())
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .collect())
    }

    /// The plain entries of `dir` (not dot files), after checking who could
    /// change it; `None` when it does not exist.
    fn entries(&self, dir: &Path) -> Result<Option<Vec<(String, PathBuf)>>, HostPortError> {
        let read = match std::fs::read_dir(dir) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.fault(format!("{}: {e}", dir.display()))),
        };
        self.check_secure(dir)?;
        let mut out = Vec::new();
        for e in read {
            let e = e.map_err(|e| self.fault(format!("{}: {e}", dir.display())))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') {
                out.push((name, e.path()));
            }
        }
        Ok(Some(out))
    }

    /// Takes the host-wide lock, waiting up to [`LOCK_WAIT`] for another
    /// vkd's check to end.
    pub fn lock(&self) -> Result<HostLock, HostPortError> {
        use std::os::unix::fs::OpenOptionsExt;
        self.make_dir(&self.dir)?;
        let path = self.dir.join(LOCK);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| self.fault(format!("{}: {e}", path.display())))?;
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(HostLock { file }),
                Err(rustix::io::Errno::WOULDBLOCK | rustix::io::Errno::INTR)
                    if Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    return Err(self.fault(format!(
                        "locking {} (held by another vkd for {}s?): {e}",
                        path.display(),
                        LOCK_WAIT.as_secs()
                    )));
                }
            }
        }
    }
}

/// The first line of a small regular file (not followed if a link), with
/// control characters replaced: it ends up in a Pod's status.
fn read_line(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    let mut bytes = Vec::new();
    f.take(ENTRY_MAX).read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes);
    Ok(text
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect())
}

/// FNV-1a, 64 bits: a registration's file name from its path (the path
/// itself is the content; the name only keeps one file per node).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The `hostPort`s Pods hold, from the recorded networks in each of `dirs`
/// (Pods directories), but for the sandbox `except`: each as its Pod's UID
/// and its ports.
pub fn held_by_pods(dirs: &[PathBuf], except: &Path) -> Vec<(String, Vec<HostPort>)> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for dir in dirs {
        if !seen.insert(dir) {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if e.file_name().to_string_lossy().starts_with('.') || path == except {
                continue;
            }
            if let Ok(Some(a)) = crate::network::attachment_of(&path)
                && !a.host_ports().is_empty()
            {
                out.push((a.pod_uid().to_owned(), a.host_ports().to_vec()));
            }
        }
    }
    out
}

/// A socket the host serves on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    /// `TCP` or `UDP`, as a `hostPort`'s protocol is written.
    pub protocol: &'static str,
    pub addr: IpAddr,
    pub port: u16,
}

/// TCP_LISTEN and TCP_CLOSE (an unconnected UDP socket: a server) in
/// `/proc/net`'s `st` column.
const TCP_LISTEN: u8 = 0x0A;
const UDP_UNCONNECTED: u8 = 0x07;

/// Every socket the calling thread's network namespace serves on. The
/// thread's (not the process's): it is the one the CNI plugins, started from
/// this thread, program.
pub fn host_listeners() -> Result<Vec<Listener>, HostPortError> {
    let base = if Path::new("/proc/thread-self/net").exists() {
        Path::new("/proc/thread-self/net")
    } else {
        Path::new("/proc/self/net")
    };
    let mut out = Vec::new();
    for (file, protocol, state) in [
        ("tcp", "TCP", TCP_LISTEN),
        ("tcp6", "TCP", TCP_LISTEN),
        ("udp", "UDP", UDP_UNCONNECTED),
        ("udp6", "UDP", UDP_UNCONNECTED),
    ] {
        let path = base.join(file);
        match std::fs::read_to_string(&path) {
            Ok(text) => out.extend(parse_table(&text, protocol, state)),
            // A kernel without IPv6 has no tcp6 or udp6.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && file.ends_with('6') => {}
            Err(source) => return Err(HostPortError::Read { path, source }),
        }
    }
    Ok(out)
}

/// The sockets in state `state` of one `/proc/net` table.
fn parse_table(text: &str, protocol: &'static str, state: u8) -> Vec<Listener> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let local = fields.nth(1)?;
            let st = u8::from_str_radix(fields.nth(1)?, 16).ok()?;
            if st != state {
                return None;
            }
            let (addr, port) = local.split_once(':')?;
            Some(Listener {
                protocol,
                addr: parse_addr(addr)?,
                port: u16::from_str_radix(port, 16).ok()?,
            })
        })
        .collect()
}

/// A `/proc/net` address: the address's bytes as the kernel holds them
/// (network order), printed as 32-bit words in the host's byte order.
fn parse_addr(hex: &str) -> Option<IpAddr> {
    if !matches!(hex.len(), 8 | 32) || !hex.is_ascii() {
        return None;
    }
    let mut bytes = Vec::with_capacity(16);
    for i in (0..hex.len()).step_by(8) {
        let word = u32::from_str_radix(&hex[i..i + 8], 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    match <[u8; 4]>::try_from(bytes.as_slice()) {
        Ok(v4) => Some(IpAddr::V4(Ipv4Addr::from(v4))),
        Err(_) => {
            let v6: [u8; 16] = bytes.try_into().ok()?;
            Some(Ipv6Addr::from(v6).to_canonical())
        }
    }
}

/// The host address a `hostPort` is for: `None` for every address (no
/// `hostIP`, an unspecified one, or one that does not parse: the widest
/// reading is the safe one).
fn host_ip(p: &HostPort) -> Option<IpAddr> {
    p.host_ip
        .as_deref()
        .and_then(|h| h.parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical())
        .filter(|ip| !ip.is_unspecified())
}

/// Whether traffic for addresses `a` and `b` (`None`: every address) meets.
fn overlap(a: Option<IpAddr>, b: Option<IpAddr>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// Refuses the first of `ports` that a socket in `listeners` serves, or that
/// a Pod in `pods` (its UID and `hostPort`s) holds.
pub fn check(
    ports: &[HostPort],
    listeners: &[Listener],
    pods: &[(String, Vec<HostPort>)],
) -> Result<(), HostPortError> {
    for p in ports {
        let wanted = host_ip(p);
        let in_use = |by: String| HostPortError::InUse {
            port: p.host_port,
            protocol: p.protocol.to_ascii_uppercase(),
            by,
        };
        if let Some(l) = listeners.iter().find(|l| {
            l.port == p.host_port
                && l.protocol.eq_ignore_ascii_case(&p.protocol)
                && overlap(wanted, Some(l.addr).filter(|a| !a.is_unspecified()))
        }) {
            let at = std::net::SocketAddr::new(l.addr, l.port);
            return Err(in_use(format!(
                "a host service listens on {at}, whose traffic the Pod's port mapping would take"
            )));
        }
        for (uid, theirs) in pods {
            if theirs.iter().any(|q| {
                q.host_port == p.host_port
                    && q.protocol.eq_ignore_ascii_case(&p.protocol)
                    && overlap(wanted, host_ip(q))
            }) {
                return Err(in_use(format!("Pod {uid} holds it")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    fn port(n: u16, protocol: &str, ip: Option<&str>) -> HostPort {
        HostPort {
            container_port: 80,
            host_port: n,
            protocol: protocol.into(),
            host_ip: ip.map(Into::into),
        }
    }

    fn listener(protocol: &'static str, addr: &str, port: u16) -> Listener {
        Listener {
            protocol,
            addr: addr.parse().unwrap(),
            port,
        }
    }

    #[test]
    fn proc_net_tables_are_read_in_the_kernels_byte_order() {
        // 127.0.0.1:2379 listening, 0.0.0.0:10250 listening, an established
        // connection, and (tcp6) [::]:22 and [::ffff:10.0.0.5]:8080.
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue\n\
            0: 0100007F:094B 00000000:0000 0A 00000000:00000000 00:00000000\n\
            1: 00000000:280A 00000000:0000 0A 00000000:00000000 00:00000000\n\
            2: 0100007F:094B 0100007F:D2F0 01 00000000:00000000 00:00000000\n";
        let v6 = "  sl  local_address remote_address st\n\
            0: 00000000000000000000000000000000:0016 00000000000000000000000000000000:0000 0A 0\n\
            1: 0000000000000000FFFF00000500000A:1F90 00000000000000000000000000000000:0000 0A 0\n\
            2: garbage\n";
        if cfg!(target_endian = "little") {
            assert_eq!(
                parse_table(v4, "TCP", TCP_LISTEN),
                vec![
                    listener("TCP", "127.0.0.1", 2379),
                    listener("TCP", "0.0.0.0", 10250)
                ]
            );
            assert_eq!(
                parse_table(v6, "TCP", TCP_LISTEN),
                vec![listener("TCP", "::", 22), listener("TCP", "10.0.0.5", 8080)]
            );
        }
        assert!(parse_table(v4, "UDP", UDP_UNCONNECTED).is_empty());
        assert_eq!(parse_addr("0100007"), None);
        assert_eq!(parse_addr("zz00007F"), None);
    }

    #[test]
    fn a_port_the_host_or_another_pod_serves_is_refused_where_the_addresses_meet() {
        let host = [
            listener("TCP", "127.0.0.1", 2379),
            listener("TCP", "::", 10250),
            listener("UDP", "10.0.0.5", 53),
        ];
        let refused = |p: HostPort| check(&[p], &host, &[]).is_err();
        // Without hostIP the mapping is on every address, loopback included.
        assert!(refused(port(2379, "TCP", None)));
        assert!(refused(port(2379, "tcp", Some("0.0.0.0"))));
        assert!(refused(port(2379, "TCP", Some("127.0.0.1"))));
        assert!(!refused(port(2379, "TCP", Some("10.0.0.5"))));
        assert!(!refused(port(2379, "UDP", None)));
        // A socket on every address meets any hostIP.
        assert!(refused(port(10250, "TCP", Some("10.0.0.5"))));
        assert!(refused(port(53, "UDP", Some("::ffff:10.0.0.5"))));
        assert!(!refused(port(53, "UDP", Some("10.0.0.6"))));
        assert!(!refused(port(8080, "TCP", None)));
        let e = check(&[port(10250, "TCP", None)], &host, &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "hostPort 10250/TCP is in use on this node: a host service listens on [::]:10250"
            ),
            "{e}"
        );
        let pods = [(
            "u-other".to_owned(),
            vec![port(8080, "TCP", Some("10.0.0.5"))],
        )];
        let e = check(&[port(8080, "TCP", None)], &[], &pods)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Pod u-other holds it"), "{e}");
        assert!(check(&[port(8080, "TCP", Some("10.0.0.6"))], &[], &pods).is_ok());
        assert!(check(&[port(8080, "UDP", None)], &[], &pods).is_ok());
    }

    /// A directory of the test's own under the temp dir (sticky, so it
    /// passes the ownership check), removed at the end.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "vkd-hostport-{name}-{}",
                uuid::Uuid::new_v4().simple()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A port nothing on the host listens on now.
    fn unused_port() -> u16 {
        let l = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        l.local_addr().unwrap().port()
    }

    /// Pod Security baseline: no hostPort unless the node policy names it;
    /// the refusal says which ports the node gives out and which config
    /// field decides.
    #[test]
    fn a_hostport_is_refused_unless_the_node_policy_names_it() {
        let none = check_allowed(&[port(8080, "TCP", None)], &[], "vk-1").unwrap_err();
        assert_eq!(none.reason(), Some(HOST_PORT_NOT_ALLOWED));
        let e = none.to_string();
        assert!(
            e.starts_with(
                "hostPort 8080/TCP is not allowed on node vk-1: the node allows no hostPort"
            ) && e.contains("hostPorts.allowed"),
            "{e}"
        );
        let allowed = [
            PortRange {
                first: 30000,
                last: 32767,
            },
            PortRange {
                first: 8080,
                last: 8080,
            },
        ];
        for ok in [30000, 30080, 32767, 8080] {
            check_allowed(&[port(ok, "TCP", None)], &allowed, "vk-1").unwrap();
        }
        let e = check_allowed(
            &[port(30080, "TCP", None), port(80, "udp", None)],
            &allowed,
            "vk-1",
        )
        .unwrap_err();
        assert_eq!(e.reason(), Some(HOST_PORT_NOT_ALLOWED));
        assert_eq!(
            e.to_string(),
            "hostPort 80/UDP is not allowed on node vk-1: the node gives out only 30000-32767, \
             8080 (hostPorts.allowed in the process provider config)"
        );
        assert!(check_allowed(&[], &[], "vk-1").is_ok());
    }

    /// The finding: while one vkd restarts nothing listens on its kubelet
    /// port, so what listens now cannot tell; its reservation, written at
    /// its start and never removed, still refuses the port to any node's
    /// Pod, on every protocol and address.
    #[test]
    fn a_port_a_stopped_vkd_reserved_is_refused_though_nothing_listens() {
        let dir = TempDir::new("stopped");
        let (kubelet, admin) = (unused_port(), unused_port());
        // vkd "vk-2" starts, reserves its ports, and stops.
        {
            let theirs = Reservations::new(dir.0.join("host-ports"));
            let ports = BTreeMap::from([
                (kubelet, "vkd's kubelet API (--kubelet-port)".to_owned()),
                (admin, "vkd's admin server (--admin-port)".to_owned()),
            ]);
            theirs.reserve(&ports, "vk-2").unwrap();
        }
        // Another node's check, with nothing listening on either port.
        let ours = Reservations::new(dir.0.join("host-ports"));
        let listeners = host_listeners().unwrap();
        let wanted = [port(kubelet, "TCP", None)];
        assert!(
            check(&wanted, &listeners, &[]).is_ok(),
            "something listens on {kubelet}: the test cannot show the snapshot misses it"
        );
        let reserved = ours.reserved().unwrap();
        let e = check_reserved(&wanted, &reserved).unwrap_err();
        assert_eq!(e.reason(), Some(HOST_PORT_NOT_ALLOWED));
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "hostPort {kubelet}/TCP is reserved on this host for vkd's kubelet API \
                 (--kubelet-port), vkd of node vk-2 ("
            )) && text.contains("whether or not it listens now"),
            "{text}"
        );
        for other in [
            port(admin, "UDP", Some("10.0.0.5")),
            port(admin, "SCTP", None),
        ] {
            assert!(check_reserved(&[other], &reserved).is_err());
        }
        assert!(check_reserved(&[port(unused_port(), "TCP", None)], &reserved).is_ok());
    }

    /// A reservation is a file per port that stays when its vkd stops, and
    /// that its next start writes again in place; the directory is made
    /// root's (vkd's) alone.
    #[test]
    fn a_reservation_survives_its_vkd_and_a_restart_rewrites_it() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = TempDir::new("survives");
        let at = dir.0.join("host-ports");
        let ports = BTreeMap::from([(10250, "vkd's kubelet API (--kubelet-port)".to_owned())]);
        Reservations::new(&at).reserve(&ports, "vk-1").unwrap();
        let file = at.join("10250");
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "vkd's kubelet API (--kubelet-port), vkd of node vk-1\n"
        );
        let m = std::fs::metadata(&at).unwrap();
        assert_eq!(m.mode() & 0o777, 0o755);
        assert_eq!(m.uid(), rustix::process::geteuid().as_raw());
        // Stopped (nothing removes it), then started again.
        Reservations::new(&at).reserve(&ports, "vk-1").unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&at)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        // The port, and the host's lock its reservation was made under.
        assert_eq!(names, [".lock", "10250"]);
        assert_eq!(Reservations::new(&at).reserved().unwrap().len(), 1);
        // A directory others may write is no reservation at all: refused,
        // as a fault of the host's (retried), not the Pod's.
        std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = Reservations::new(&at).reserved().unwrap_err();
        assert_eq!(e.reason(), None);
        assert!(e.to_string().contains("writable by no one else"), "{e}");
        assert!(Reservations::new(&at).lock().is_err());
    }

    /// The lock is one for every vkd on the host (a file lock, not a lock
    /// of this process): a second holder waits until the first lets go.
    #[test]
    fn the_lock_is_taken_by_one_check_at_a_time_and_released() {
        let dir = TempDir::new("lock");
        let at = dir.0.join("host-ports");
        let first = Reservations::new(&at).lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let other = at.clone();
        let waiter = std::thread::spawn(move || {
            let second = Reservations::new(other).lock().unwrap();
            tx.send(()).unwrap();
            drop(second);
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "two holders at once"
        );
        drop(first);
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the lock was not released");
        waiter.join().unwrap();
        Reservations::new(&at).lock().unwrap();
    }

    /// The Pods of every node registered on the host count, but for the
    /// Pod being checked itself.
    #[test]
    fn every_registered_nodes_pods_hold_their_ports() {
        let dir = TempDir::new("nodes");
        let at = Reservations::new(dir.0.join("host-ports"));
        let (a, b) = (dir.0.join("a/pods"), dir.0.join("b/pods"));
        for (pods, uid, n) in [(&a, "u-a", 30080), (&b, "u-b", 30081)] {
            std::fs::create_dir_all(pods.join(uid)).unwrap();
            let record = serde_json::json!({
                "list": {}, "bin_dir": "/opt/cni/bin", "netns": "/x", "container_id": uid,
                "args": "", "port_mappings": [
                    {"container_port": 80, "host_port": n, "protocol": "TCP", "host_ip": null}
                ]
            });
            std::fs::write(pods.join(uid).join("network.json"), record.to_string()).unwrap();
            at.register_pods(pods).unwrap();
        }
        at.register_pods(&a).unwrap();
        let dirs = at.pods_dirs().unwrap();
        assert_eq!(dirs.len(), 2, "{dirs:?}");
        let held = held_by_pods(&dirs, &a.join("u-new"));
        let e = check(&[port(30081, "TCP", None)], &[], &held).unwrap_err();
        assert_eq!(e.reason(), Some(HOST_PORT_IN_USE));
        assert!(e.to_string().contains("Pod u-b holds it"), "{e}");
        // The Pod's own record is not another's.
        let own = held_by_pods(&dirs, &a.join("u-a"));
        assert!(check(&[port(30080, "TCP", None)], &[], &own).is_ok());
        assert!(at.register_pods(Path::new("relative/pods")).is_err());
        // A vkd that would serve a port a Pod already holds says so at its
        // start, naming the Pod, rather than serve behind its DNAT.
        let serves = BTreeMap::from([(30081, "vkd's kubelet API (--kubelet-port)".to_owned())]);
        let e = at.reserve(&serves, "vk-c").unwrap_err();
        assert!(
            e.to_string().contains("30081") && e.to_string().contains("u-b"),
            "{e}"
        );
        let free = BTreeMap::from([(30082, "vkd's admin server (--admin-port)".to_owned())]);
        at.reserve(&free, "vk-c").unwrap();
    }

    /// What this host serves now, read from /proc: a listener the test opens
    /// shows, on its address and port.
    #[test]
    fn the_hosts_own_listeners_are_found() {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let found = host_listeners().unwrap();
        let t = tcp.local_addr().unwrap();
        let u = udp.local_addr().unwrap();
        assert!(
            found.contains(&listener("TCP", "127.0.0.1", t.port())),
            "{t} not in {found:?}"
        );
        assert!(
            found.contains(&listener("UDP", "127.0.0.1", u.port())),
            "{u} not in {found:?}"
        );
        assert!(check(&[port(t.port(), "TCP", None)], &found, &[]).is_err());
    }
}
