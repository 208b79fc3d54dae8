//! Pods with network namespaces of their own, set up by the standard CNI
//! plugins (bridge, host-local, loopback, portmap, built by
//! `e2e/cluster build-cni`), where the tests run as root: an IP per Pod, two
//! Pods on one port, port 80 as the run-as user, the IP in the environment,
//! port-forward to the Pod's loopback, and every IP back in the pool once the
//! Pods are gone, also after a create that died half way.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{config, fence, log_text, remove, running, shim_exe, spec, wait_for};
use vkd_process::ProcessProvider;
use vkd_provider::{Provider, RestartPolicy};

/// The CNI plugins' directory, built (or found in the cache) by the harness.
fn cni_bin() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/cluster");
    let out = std::process::Command::new(script)
        .arg("build-cni")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "e2e/cluster build-cni: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A test's own network: a bridge and a /24 no other test uses.
struct TestNet {
    dir: PathBuf,
    bridge: String,
    subnet: String,
}

impl TestNet {
    fn new(n: u8) -> Self {
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("vkd-net-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            dir,
            bridge: format!("vkt{:x}{n}", pid & 0xffff),
            subnet: format!("10.{}.{}.0/24", 180 + n, pid % 250),
        }
    }

    /// The provider on this network, when the host gives containers
    /// namespaces; else `None` (the test says so and passes).
    fn provider(&self) -> Option<ProcessProvider> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("not root: no network namespaces to check");
            return None;
        }
        let conf = self.dir.join("pods.conflist");
        std::fs::write(
            &conf,
            serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "vkd-test",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": self.bridge,
                        "isGateway": true,
                        "isDefaultGateway": true,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": self.subnet}]],
                            "dataDir": self.ipam_dir(),
                        }
                    },
                    {"type": "portmap", "capabilities": {"portMappings": true}}
                ]
            })
            .to_string(),
        )
        .unwrap();
        let mut cfg = config();
        cfg.network = Some(vkd_process::config::NetworkConfig {
            cni_config: conf,
            cni_bin_dir: cni_bin(),
            plugin_timeout_seconds: None,
        });
        cfg.host_ports.allowed = every_port();
        cfg.host_ports.reservations = self.dir.join("host-ports");
        let p = ProcessProvider::open(cfg, &self.dir.join("state"), shim_exe()).unwrap();
        if p.isolation_mode() != "namespaces" {
            eprintln!("no namespaces here: nothing to check");
            return None;
        }
        Some(p)
    }

    fn ipam_dir(&self) -> PathBuf {
        self.dir.join("ipam")
    }

    /// The IPs host-local holds for Pods.
    fn reserved(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.ipam_dir().join("vkd-test")) else {
            return Vec::new();
        };
        let mut ips: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
            .collect();
        ips.sort();
        ips
    }

    fn netns_files(&self) -> usize {
        std::fs::read_dir(self.dir.join("state/netns")).map_or(0, |d| d.count())
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.bridge])
            .output();
        for mount in ["state/netns", "state/ns"] {
            let _ =
                rustix::mount::unmount(self.dir.join(mount), rustix::mount::UnmountFlags::DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server that answers every connection on each of `ports` with `text`.
fn server(text: &str, ports: &[u16]) -> Vec<String> {
    let binds: Vec<String> = ports.iter().map(|p| format!("('0.0.0.0', {p})")).collect();
    let script = format!(
        "import socket, threading\n\
         def serve(addr):\n\
         \x20   s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         \x20   s.bind(addr); s.listen()\n\
         \x20   print('listening', addr[1], flush=True)\n\
         \x20   while True:\n\
         \x20       c, _ = s.accept(); c.sendall(b'{text}\\n'); c.close()\n\
         for a in [{}]:\n\
         \x20   threading.Thread(target=serve, args=(a,)).start()\n",
        binds.join(", ")
    );
    vec!["python3".into(), "-c".into(), script]
}

fn read_from(addr: std::net::SocketAddr) -> std::io::Result<String> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out.trim().to_owned())
}

/// Waits until the container's log says it listens on all `n` ports.
async fn listening(p: &ProcessProvider, uid: &str, n: usize) {
    wait_for("the server to listen", async || {
        (log_text(p, uid, "main").await.matches("listening").count() >= n).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pods_get_their_own_ips_share_a_port_and_give_the_ips_back() {
    let net = TestNet::new(0);
    let Some(p) = net.provider() else { return };
    let mut a = spec("u-net-a", &[]);
    a.containers[0].command = server("from-a", &[8080, 80]);
    a.containers[0].image = "busybox".into();
    a.containers[0].env = vec![("MY_IP".into(), "192.0.2.1".into())];
    a.containers[0].pod_ip_env = vec!["MY_IP".into()];
    let mut b = spec("u-net-b", &[]);
    b.containers[0].command = server("from-b", &[8080]);
    for s in [&a, &b] {
        p.create(&fence(), s).await.unwrap();
    }
    let ia = running(&p, "u-net-a").await;
    let ib = running(&p, "u-net-b").await;
    let (ip_a, ip_b) = (ia.ip.clone().unwrap(), ib.ip.clone().unwrap());
    assert_ne!(ip_a, ip_b);
    let prefix = net.subnet.trim_end_matches("0/24");
    assert!(
        ip_a.starts_with(prefix) && ip_b.starts_with(prefix),
        "{ip_a} {ip_b}"
    );
    listening(&p, "u-net-a", 2).await;
    listening(&p, "u-net-b", 1).await;
    let at = |ip: &str, port: u16| std::net::SocketAddr::new(ip.parse().unwrap(), port);
    // Both on 8080, each at its own IP; port 80 bound by uid 65534.
    assert_eq!(read_from(at(&ip_a, 8080)).unwrap(), "from-a");
    assert_eq!(read_from(at(&ip_b, 8080)).unwrap(), "from-b");
    assert_eq!(read_from(at(&ip_a, 80)).unwrap(), "from-a");
    assert_eq!(net.reserved(), {
        let mut v = vec![ip_a.clone(), ip_b.clone()];
        v.sort();
        v
    });
    // The variable that names the Pod's IP holds it; exec is in the Pod's network.
    let (tx, mut rx) = tokio::io::duplex(4096);
    let code = p
        .exec(
            "u-net-a",
            "main",
            vec![
                "sh".into(),
                "-c".into(),
                "echo ip=$MY_IP; cat /etc/hosts | tail -1; \
                 python3 -c \"import socket; s=socket.create_connection(('$PEER', 8080)); print(s.recv(9).decode())\""
                    .replace("$PEER", &ip_b),
            ],
            common::stream_io(tx, false),
        )
        .await
        .unwrap();
    let mut out = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut rx, &mut out)
        .await
        .unwrap();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&format!("ip={ip_a}")), "{out}");
    assert!(out.contains(&format!("{ip_a}\tpod-u-net-a")), "{out}");
    assert!(out.contains("from-b"), "{out}");
    remove(&p, "u-net-a").await;
    remove(&p, "u-net-b").await;
    assert!(net.reserved().is_empty(), "{:?}", net.reserved());
    assert_eq!(net.netns_files(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn port_forward_reaches_the_pods_own_loopback_and_host_ports_are_mapped() {
    let net = TestNet::new(1);
    let Some(p) = net.provider() else { return };
    let mut s = spec("u-net-pf", &[]);
    // Only on the Pod's loopback: no one outside its namespace reaches it.
    s.containers[0].command = vec![
        "python3".into(),
        "-c".into(),
        "import socket\n\
         s = socket.socket(); s.bind(('127.0.0.1', 9090)); s.listen()\n\
         t = socket.socket(); t.bind(('0.0.0.0', 8080)); t.listen()\n\
         print('listening', flush=True)\n\
         import threading\n\
         def serve(x, text):\n\
         \x20   while True:\n\
         \x20       c, _ = x.accept(); c.sendall(text); c.close()\n\
         threading.Thread(target=serve, args=(t, b'mapped\\n')).start()\n\
         serve(s, b'loopback\\n')\n"
            .into(),
    ];
    let host_port = 20000 + (std::process::id() % 20000) as u16;
    s.host_ports = vec![vkd_provider::HostPort {
        container_port: 8080,
        host_port,
        protocol: "TCP".into(),
        host_ip: None,
    }];
    s.restart_policy = RestartPolicy::Never;
    p.create(&fence(), &s).await.unwrap();
    let i = running(&p, "u-net-pf").await;
    listening(&p, "u-net-pf", 1).await;
    let ip = i.ip.unwrap();
    assert!(
        read_from(std::net::SocketAddr::new(ip.parse().unwrap(), 9090)).is_err(),
        "the Pod's loopback is reachable from outside it"
    );
    let (ours, theirs) = tokio::io::duplex(4096);
    let forward = {
        let p = p.clone();
        tokio::spawn(async move { p.port_forward("u-net-pf", 9090, Box::new(theirs)).await })
    };
    let mut ours = ours;
    let mut got = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut ours, &mut got)
        .await
        .unwrap();
    assert_eq!(got.trim(), "loopback");
    drop(ours);
    forward.await.unwrap().unwrap();
    // The hostPort, at an address of the host's own other than loopback.
    let host_addr = host_address();
    match host_addr {
        Some(h) => assert_eq!(
            read_from(std::net::SocketAddr::new(h, host_port)).unwrap(),
            "mapped"
        ),
        None => eprintln!("the host has no address but loopback: hostPort not checked"),
    }
    remove(&p, "u-net-pf").await;
    assert!(net.reserved().is_empty(), "{:?}", net.reserved());
    if let Some(h) = host_addr {
        assert!(
            read_from(std::net::SocketAddr::new(h, host_port)).is_err(),
            "the hostPort outlived the Pod"
        );
    }
}

/// An IPv4 address of the host's that is not loopback (and not a test bridge's).
fn host_address() -> Option<std::net::IpAddr> {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            !l.split_whitespace()
                .nth(1)
                .is_some_and(|d| d.starts_with("vkt"))
        })
        .find_map(|l| {
            let addr = l.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
            addr.split('/').next()?.parse().ok()
        })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_create_that_died_half_way_gives_its_ip_back_and_host_network_pods_get_none() {
    let net = TestNet::new(2);
    let Some(p) = net.provider() else { return };
    let s = spec("u-net-half", &["sleep", "3602"]);
    p.create(&fence(), &s).await.unwrap();
    let ip = running(&p, "u-net-half").await.ip.unwrap();
    assert_eq!(net.reserved(), vec![ip]);
    // As if vkd, the shim and the Pod died after ADD and before the sandbox
    // was complete: the next start finds a sandbox without instance.json.
    drop(p);
    let state = net.dir.join("state/pods/u-net-half");
    let shim: i32 = std::fs::read_to_string(state.join("shim.pid"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(shim).unwrap(),
        rustix::process::Signal::KILL,
    );
    let _ = std::process::Command::new("pkill")
        .args(["-9", "-f", "sleep 3602"])
        .status();
    std::fs::remove_file(state.join("instance.json")).unwrap();
    let p = net.provider().unwrap();
    assert!(!state.exists(), "the half-made sandbox is still there");
    assert!(net.reserved().is_empty(), "{:?}", net.reserved());
    assert_eq!(net.netns_files(), 0);
    // hostNetwork: no namespace, no IP of its own.
    let mut h = spec("u-net-host", &["sleep", "3601"]);
    h.host_network = true;
    p.create(&fence(), &h).await.unwrap();
    let i = running(&p, "u-net-host").await;
    assert_eq!(i.ip, None);
    assert!(net.reserved().is_empty());
    remove(&p, "u-net-host").await;
}

/// A network of stand-in CNI plugins, for what the real ones cannot be made
/// to do on cue: `fake` hangs on ADD for a Pod named `pod-u-hang*`, fails for
/// `pod-u-fail*` (a CNI error) and `pod-u-noisy*` (pages of stderr), and
/// otherwise gives every Pod 10.99.0.2; it records each call in `calls`.
struct FakeNet {
    dir: PathBuf,
}

impl FakeNet {
    fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("vkd-fakenet-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        Self { dir }
    }

    /// The provider on this network (plugins bounded to `timeout` seconds),
    /// when the host gives containers namespaces; else `None` (the test says
    /// so and passes).
    fn provider(&self, timeout: u64) -> Option<ProcessProvider> {
        self.node("state", timeout, &every_port())
    }

    /// A node on this network with its state in `state` (under the test's
    /// directory) giving out the hostPorts `allowed`; every node of the test
    /// shares the host's port reservations (`host-ports`).
    fn node(
        &self,
        state: &str,
        timeout: u64,
        allowed: &[vkd_process::config::PortRange],
    ) -> Option<ProcessProvider> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("not root: no network namespaces to check");
            return None;
        }
        let calls = self.dir.join("calls");
        let prelude = format!(
            "case \"$CNI_COMMAND\" in VERSION) exit 0;; esac\n\
             cat >/dev/null\n\
             echo \"$(basename \"$0\") $CNI_COMMAND $CNI_CONTAINERID\" >> {}\n",
            calls.display()
        );
        script(
            &self.dir.join("bin/loopback"),
            &format!("{prelude}echo '{{}}'\n"),
        );
        script(
            &self.dir.join("bin/fake"),
            &format!(
                "{prelude}[ \"$CNI_COMMAND\" = DEL ] && exit 0\n\
                 case \"$CNI_ARGS\" in\n\
                 *K8S_POD_NAME=pod-u-hang*) exec sleep 1000 ;;\n\
                 *K8S_POD_NAME=pod-u-fail*)\n\
                 \x20 echo 'partial output' >&2\n\
                 \x20 echo '{{\"cniVersion\":\"1.0.0\",\"code\":11,\"msg\":\"no addresses left\",\"details\":\"range 10.99.0.0/30 is full\"}}'\n\
                 \x20 exit 1 ;;\n\
                 *K8S_POD_NAME=pod-u-noisy*) seq 1 100000 >&2; exit 2 ;;\n\
                 esac\n\
                 echo '{{\"cniVersion\":\"1.0.0\",\"ips\":[{{\"address\":\"10.99.0.2/24\"}}]}}'\n"
            ),
        );
        let conf = self.dir.join("pods.conflist");
        std::fs::write(
            &conf,
            r#"{"cniVersion":"1.0.0","name":"vkd-fake","plugins":[{"type":"fake"}]}"#,
        )
        .unwrap();
        let mut cfg = config();
        cfg.network = Some(vkd_process::config::NetworkConfig {
            cni_config: conf,
            cni_bin_dir: self.dir.join("bin"),
            plugin_timeout_seconds: Some(timeout),
        });
        cfg.host_ports.allowed = allowed.to_vec();
        cfg.host_ports.reservations = self.dir.join("host-ports");
        let p = ProcessProvider::open(cfg, &self.dir.join(state), shim_exe()).unwrap();
        if p.isolation_mode() != "namespaces" {
            eprintln!("no namespaces here: nothing to check");
            return None;
        }
        Some(p)
    }

    /// The plugin calls so far: `<plugin> <command> <pod uid>` each.
    fn calls(&self) -> String {
        std::fs::read_to_string(self.dir.join("calls")).unwrap_or_default()
    }

    fn sandbox(&self, uid: &str) -> PathBuf {
        self.dir.join("state/pods").join(uid)
    }

    fn netns_files(&self) -> usize {
        std::fs::read_dir(self.dir.join("state/netns")).map_or(0, |d| d.count())
    }
}

impl Drop for FakeNet {
    fn drop(&mut self) {
        for mount in ["state/netns", "state/ns", "state-b/netns", "state-b/ns"] {
            let _ =
                rustix::mount::unmount(self.dir.join(mount), rustix::mount::UnmountFlags::DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes an executable script, and waits until it can be run: a process
/// forked meanwhile by another test may hold it open for writing a moment
/// (ETXTBSY).
fn script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    for _ in 0..200 {
        match std::process::Command::new(path)
            .env("CNI_COMMAND", "VERSION")
            .output()
        {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(Duration::from_millis(10));
            }
            _ => return,
        }
    }
}

/// The reason and message of a create that the provider refused for the Pod.
/// `hostPorts.allowed: ["1-65535"]`: the tests of what else refuses a port.
fn every_port() -> Vec<vkd_process::config::PortRange> {
    vec![vkd_process::config::PortRange {
        first: 1,
        last: 65535,
    }]
}

fn refusal(r: vkd_provider::Result<vkd_provider::Instance>) -> (String, String) {
    match r {
        Err(vkd_provider::ProviderError::Invalid { reason, message }) => (reason, message),
        other => panic!("not refused for the Pod: {other:?}"),
    }
}

/// While one Pod's ADD hangs, other Pods are created and deleted at once
/// (no plugin runs under the node's fence lock), and so is the hung Pod's
/// own deletion; the hung plugin is killed at its bound and that Pod's
/// create fails saying so, leaving nothing behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_plugin_stalls_only_its_own_pod() {
    const BOUND: u64 = 20;
    let net = FakeNet::new();
    let Some(p) = net.provider(BOUND) else { return };
    p.create(&fence(), &spec("u-done", &[])).await.unwrap();
    running(&p, "u-done").await;
    let began = std::time::Instant::now();
    let hung = {
        let p = p.clone();
        tokio::spawn(async move { p.create(&fence(), &spec("u-hang", &[])).await })
    };
    wait_for("the plugin to hang", async || {
        net.calls().contains("fake ADD u-hang").then_some(())
    })
    .await;
    let b = p.create(&fence(), &spec("u-other", &[])).await.unwrap();
    assert_eq!(b.ip.as_deref(), Some("10.99.0.2"));
    remove(&p, "u-done").await;
    // The hung Pod's own deletion: answered now, finished by its create.
    p.delete(&fence(), "u-hang", Duration::from_secs(1))
        .await
        .unwrap();
    assert!(p.get("u-hang").await.unwrap().is_none());
    assert!(
        !hung.is_finished(),
        "the hung create ended before the others were done ({:?})",
        began.elapsed()
    );
    let (reason, message) = refusal(hung.await.unwrap());
    assert_eq!(reason, vkd_provider::SANDBOX_NOT_CREATED);
    assert!(
        message.contains("CNI plugin fake (ADD)") && message.contains(&format!("{BOUND}s")),
        "{message}"
    );
    assert!(began.elapsed() >= Duration::from_secs(BOUND));
    assert!(!net.sandbox("u-hang").exists());
    assert!(net.calls().contains("fake DEL u-hang"), "{}", net.calls());
    remove(&p, "u-other").await;
    assert_eq!(net.netns_files(), 0);
}

/// A failed ADD is the Pod's failure, with a reason and the plugin's own
/// words, cut to a bounded size; what was set up is given back.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_add_reaches_the_pod_with_the_plugins_words() {
    let net = FakeNet::new();
    let Some(p) = net.provider(60) else { return };
    let (reason, message) = refusal(p.create(&fence(), &spec("u-fail", &[])).await);
    assert_eq!(reason, vkd_provider::SANDBOX_NOT_CREATED);
    assert!(
        message.contains("CNI plugin fake (ADD)")
            && message.contains("no addresses left: range 10.99.0.0/30 is full"),
        "{message}"
    );
    assert!(!net.sandbox("u-fail").exists());
    assert!(net.calls().contains("fake DEL u-fail"), "{}", net.calls());
    let (reason, message) = refusal(p.create(&fence(), &spec("u-noisy", &[])).await);
    assert_eq!(reason, vkd_provider::SANDBOX_NOT_CREATED);
    assert!(message.contains("exit status: 2: 1 2 3"), "{message}");
    assert!(message.len() < 1500, "{} bytes", message.len());
    assert_eq!(net.netns_files(), 0);
}

/// A hostPort a host service listens on is refused before any plugin runs,
/// at admission and at create; a free one works, and is then refused to a
/// second Pod.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_port_the_node_uses_is_refused_before_add() {
    let net = FakeNet::new();
    let Some(p) = net.provider(60) else { return };
    let service = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let used = service.local_addr().unwrap().port();
    let with_port = |uid: &str, port: u16| {
        let mut s = spec(uid, &[]);
        s.host_ports = vec![vkd_provider::HostPort {
            container_port: 8080,
            host_port: port,
            protocol: "TCP".into(),
            host_ip: None,
        }];
        s
    };
    let s = with_port("u-hp", used);
    match p.admit(&s).await.unwrap() {
        vkd_provider::Admission::Rejected { reason, .. } => assert_eq!(reason, "HostPortInUse"),
        other => panic!("{other:?}"),
    }
    let (reason, message) = refusal(p.create(&fence(), &s).await);
    assert_eq!(reason, "HostPortInUse");
    assert!(
        message.contains(&format!("hostPort {used}/TCP"))
            && message.contains(&format!("127.0.0.1:{used}")),
        "{message}"
    );
    assert!(!net.calls().contains("u-hp"), "{}", net.calls());
    assert!(!net.sandbox("u-hp").exists());
    let free = {
        let l = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        l.local_addr().unwrap().port()
    };
    p.create(&fence(), &with_port("u-hp-free", free))
        .await
        .unwrap();
    let (reason, message) = refusal(p.create(&fence(), &with_port("u-hp-twice", free)).await);
    assert_eq!(reason, "HostPortInUse");
    assert!(message.contains("Pod u-hp-free holds it"), "{message}");
    remove(&p, "u-hp-free").await;
    drop(service);
}

/// hostPorts by policy (issue 51, finding 4): a node whose config names no
/// range gives out none; a port a vkd on the host reserved is refused though
/// nothing listens on it (its vkd is restarting); a port a Pod of another
/// node on the host holds is refused to this one. Each before any plugin
/// runs.
#[tokio::test(flavor = "multi_thread")]
async fn hostports_follow_the_node_policy_and_the_hosts_reservations() {
    let net = FakeNet::new();
    let Some(a) = net.provider(60) else { return };
    let Some(strict) = net.node("state-b", 60, &[]) else {
        return;
    };
    let with_port = |uid: &str, port: u16| {
        let mut s = spec(uid, &[]);
        s.host_ports = vec![vkd_provider::HostPort {
            container_port: 8080,
            host_port: port,
            protocol: "TCP".into(),
            host_ip: None,
        }];
        s
    };
    let unused = || {
        let l = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // No range named: none given out.
    let s = with_port("u-hp-none", unused());
    match strict.admit(&s).await.unwrap() {
        vkd_provider::Admission::Rejected { reason, .. } => {
            assert_eq!(reason, "HostPortNotAllowed")
        }
        other => panic!("{other:?}"),
    }
    let (reason, message) = refusal(strict.create(&fence(), &s).await);
    assert_eq!(reason, "HostPortNotAllowed");
    assert!(
        message.contains("the node allows no hostPort") && message.contains("hostPorts.allowed"),
        "{message}"
    );
    // A stopped vkd's kubelet port: reserved, though nothing listens.
    let kubelet = unused();
    vkd_process::hostport::Reservations::new(net.dir.join("host-ports"))
        .reserve(
            &std::collections::BTreeMap::from([(
                kubelet,
                "vkd's kubelet API (--kubelet-port)".to_owned(),
            )]),
            "vk-restarting",
        )
        .unwrap();
    let (reason, message) = refusal(a.create(&fence(), &with_port("u-hp-res", kubelet)).await);
    assert_eq!(reason, "HostPortNotAllowed");
    assert!(
        message.contains(&format!("hostPort {kubelet}/TCP is reserved on this host"))
            && message.contains("vk-restarting"),
        "{message}"
    );
    assert!(!net.sandbox("u-hp-res").exists());
    // Another node's Pod holds a port: not this node's to give.
    let held = unused();
    a.create(&fence(), &with_port("u-hp-a", held))
        .await
        .unwrap();
    let Some(b) = net.node("state-b", 60, &every_port()) else {
        return;
    };
    let (reason, message) = refusal(b.create(&fence(), &with_port("u-hp-b", held)).await);
    assert_eq!(reason, "HostPortInUse");
    assert!(message.contains("Pod u-hp-a holds it"), "{message}");
    assert!(!net.calls().contains("u-hp-b") && !net.calls().contains("u-hp-res"));
    remove(&a, "u-hp-a").await;
    b.create(&fence(), &with_port("u-hp-b", held))
        .await
        .unwrap();
    remove(&b, "u-hp-b").await;
}

/// A sandbox that a create left half made (no instance.json) is given back
/// (DEL) before the next create of that Pod runs ADD, outside the fence lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_half_made_sandbox_is_given_back_before_the_next_add() {
    let net = FakeNet::new();
    let Some(p) = net.provider(60) else { return };
    let left = net.sandbox("u-left");
    std::fs::create_dir_all(&left).unwrap();
    let record = serde_json::json!({
        "list": {"cniVersion": "1.0.0", "name": "vkd-fake", "plugins": [{"type": "fake"}]},
        "bin_dir": net.dir.join("bin"),
        "netns": net.dir.join("state/netns/u-left"),
        "container_id": "u-left",
        "args": "IgnoreUnknown=1;K8S_POD_NAMESPACE=conformance;K8S_POD_NAME=pod-u-left",
        "port_mappings": [],
    });
    std::fs::write(left.join("network.json"), record.to_string()).unwrap();
    p.create(&fence(), &spec("u-left", &[])).await.unwrap();
    let calls = net.calls();
    let del = calls.find("fake DEL u-left").expect(&calls);
    let add = calls.find("fake ADD u-left").expect(&calls);
    assert!(del < add, "{calls}");
    let pods: Vec<String> = std::fs::read_dir(net.dir.join("state/pods"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(pods, vec!["u-left".to_owned()]);
    running(&p, "u-left").await;
    remove(&p, "u-left").await;
    assert_eq!(net.netns_files(), 0);
}
