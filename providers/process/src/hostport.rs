//! The ports the node already uses, which no Pod's `hostPort` may take.
//!
//! With a Pod network a `hostPort` becomes a DNAT rule on the host (the
//! `portmap` plugin's): every connection to that port on the host's
//! addresses goes to the Pod, whatever served it before (vkd's kubelet port,
//! etcd, sshd), so a Pod could take over a host service's traffic. vkd reads
//! what the host serves (`/proc/net/{tcp,tcp6,udp,udp6}` of the network
//! namespace the plugins run in: TCP sockets in LISTEN, unconnected UDP
//! sockets) and what the node's other Pods hold (their `network.json`), and
//! refuses a Pod that asks for one of them before any plugin runs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use vkd_provider::HostPort;

/// The reason a Pod gets when it asks for a port the node uses.
pub const HOST_PORT_IN_USE: &str = "HostPortInUse";

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
