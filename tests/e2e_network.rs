//! End-to-end: process-provider Pods with network namespaces of their own,
//! set up by the standard CNI plugins (bridge, host-local, loopback, portmap,
//! built by `e2e/cluster build-cni`), on the real control plane through the
//! real kubectl. Needs root (namespaces and a bridge); elsewhere it says so
//! and passes, as the provider's own isolation tests do.

use std::io::Read;
use std::process::{ExitCode, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, repo_root, wait_for};

mod common;
use common::{Vkd, items, running_and_ready, str_at};

fn main() -> ExitCode {
    // One vkd for the suite, which one test kills: one test at a time.
    let code = Suite::serial("network", &[]).run(&[
        (
            "two_pods_share_a_port_at_their_own_ips_and_a_third_reaches_both",
            two_pods_and_a_third,
        ),
        (
            "twenty_pods_and_a_sigkill_of_vkd_give_every_ip_back",
            twenty_pods_and_a_sigkill,
        ),
        (
            "a_tenant_stays_in_its_sandbox_through_exec_probes_path_and_debug",
            a_tenant_stays_in_its_sandbox,
        ),
    ]);
    if let Some(Ok(n)) = NET.lock().unwrap_or_else(|p| p.into_inner()).take() {
        n.tear_down();
    }
    code
}

const NS: &str = "net";
const NODE: &str = "vk-net";
const NETWORK: &str = "vkd-e2e";

/// The suite's vkd and its network: a bridge and a /24 of their own.
struct Net {
    vkd: Vkd,
    bridge: String,
    subnet_prefix: String,
    ipam_dir: std::path::PathBuf,
}

impl Net {
    /// The IPs host-local holds.
    fn reserved(&self) -> Vec<String> {
        let mut ips: Vec<String> = std::fs::read_dir(self.ipam_dir.join(NETWORK))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
            .collect();
        ips.sort();
        ips
    }

    /// The network namespaces vkd keeps.
    fn namespaces(&self) -> usize {
        std::fs::read_dir(self.vkd.state_dir.join("process/netns")).map_or(0, |d| d.count())
    }

    fn tear_down(mut self) {
        let _ = self.vkd.kill();
        self.vkd.reap_processes();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

static NET: Mutex<Option<std::result::Result<Net, String>>> = Mutex::new(None);

/// Runs `f` with the suite's vkd, started on first use; `Ok(None)` where this
/// host cannot give Pods network namespaces.
fn with_net<T>(c: &Cluster, f: impl FnOnce(&mut Net) -> Result<T>) -> Result<Option<T>> {
    if !rustix_is_root() {
        eprintln!("not root: no network namespaces to check");
        return Ok(None);
    }
    let mut slot = NET.lock().unwrap_or_else(|p| p.into_inner());
    let net = slot.get_or_insert_with(|| start(c).map_err(|e| format!("{e:#}")));
    match net {
        Ok(n) => f(n).map(Some),
        Err(e) => Err(anyhow::anyhow!("vkd did not start: {e}")),
    }
}

fn rustix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("Uid:"))?.to_owned();
            line.split_whitespace().nth(2).map(|euid| euid == "0")
        })
        .unwrap_or(false)
}

fn start(c: &Cluster) -> Result<Net> {
    let pid = std::process::id();
    let bridge = format!("vke{:x}", pid & 0xfffff);
    let third = 1 + pid % 250;
    let ipam_dir = c.dir().join("ipam");
    let network = common::cni_network(c.dir(), NETWORK, &bridge, &format!("10.179.{third}.0/24"))?;
    // The suites' process config, with the network.
    let mut config = std::fs::read_to_string(repo_root().join("testdata/process/e2e.yaml"))?;
    config.push_str(&network);
    // hostPorts are given out only where the node policy names them; the
    // suite's ports are the kernel's ephemeral ones (free_port).
    config.push_str("hostPorts:\n  allowed: [\"1024-65535\"]\n");
    let config_path = c.dir().join("process-network.yaml");
    std::fs::write(&config_path, config)?;
    let ca = c.env("VKD_E2E_KUBELET_CLIENT_CA")?.to_owned();
    let vkd = Vkd::start_provider(
        c,
        NODE,
        "process",
        &config_path,
        &[
            "--node-label",
            "vkd.io/e2e=net",
            "--client-ca-file",
            &ca,
            "--allowed-namespace",
            NS,
        ],
    )?;
    c.namespace(NS)?;
    let node = wait_for(
        "the node's network annotation",
        Duration::from_secs(30),
        || {
            let n = c.kubectl_json(&["get", "node", NODE])?;
            Ok(at(&n, "metadata.annotations")
                .get("vkd.io/pod-network")
                .and_then(Value::as_str)
                .map(str::to_owned))
        },
    )?;
    ensure!(node == format!("cni:{NETWORK}"), "{node}");
    Ok(Net {
        vkd,
        bridge,
        subnet_prefix: format!("10.179.{third}."),
        ipam_dir,
    })
}

fn pod(name: &str, body: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}, labels: {{suite: net}}}}
spec:
  nodeSelector: {{vkd.io/e2e: net}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
{body}
"#
    )
}

/// A server on 8080 and 80 that answers every connection with the Pod's
/// name and the IP its environment names.
const SERVER: &str = r#"
import os, socket, threading
def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen()
    while True:
        c, _ = s.accept()
        c.sendall(("%s %s\n" % (os.environ["POD_NAME"], os.environ["POD_IP"])).encode())
        c.close()
threading.Thread(target=serve, args=(80,)).start()
serve(8080)
"#;

fn server_pod(name: &str, host_port: Option<u16>) -> String {
    let host_port = host_port.map_or(String::new(), |p| format!(", hostPort: {p}"));
    let script = serde_json::to_string(SERVER).unwrap_or_default();
    pod(
        name,
        &format!(
            r#"  containers:
  - name: server
    image: python:3
    args: ["-c", {script}]
    ports: [{{containerPort: 8080{host_port}}}]
    env:
    - {{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
    - {{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
    readinessProbe:
      tcpSocket: {{port: 8080}}
      periodSeconds: 1"#
        ),
    )
}

fn get(c: &Cluster, name: &str) -> Result<Value> {
    c.kubectl_json(&["get", "pod", name, "-n", NS])
}

fn ready(c: &Cluster, name: &str) -> Result<Value> {
    wait_for(
        &format!("{name} to be Running and Ready"),
        Duration::from_secs(60),
        || {
            let p = get(c, name)?;
            Ok(running_and_ready(&p).then_some(p))
        },
    )
}

fn read_from(addr: std::net::SocketAddr) -> Result<String> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out.trim().to_owned())
}

/// An IPv4 address of the host's own, not loopback and not a test bridge's.
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
                .is_some_and(|d| d.starts_with("vk"))
        })
        .find_map(|l| {
            let addr = l.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
            addr.split('/').next()?.parse().ok()
        })
}

fn delete_all(c: &Cluster) -> Result<()> {
    c.kubectl(&[
        "delete",
        "pods",
        "-n",
        NS,
        "-l",
        "suite=net",
        "--wait=true",
        "--timeout=120s",
    ])?;
    Ok(())
}

fn two_pods_and_a_third(c: &Cluster) -> Result<()> {
    let Some(()) = with_net(c, |net| {
        let host_port = common::free_port()?;
        c.apply(&server_pod("net-a", Some(host_port)))?;
        c.apply(&server_pod("net-b", None))?;
        let (a, b) = (ready(c, "net-a")?, ready(c, "net-b")?);
        let (ip_a, ip_b) = (str_at(&a, "status.podIP"), str_at(&b, "status.podIP"));
        ensure!(ip_a != ip_b, "both Pods have {ip_a}");
        for (p, ip) in [(&a, ip_a), (&b, ip_b)] {
            ensure!(
                ip.starts_with(&net.subnet_prefix),
                "{ip} is not in the Pod range"
            );
            ensure!(ip != str_at(p, "status.hostIP"), "the Pod IP is the host's");
            ensure!(
                at(p, "status.podIPs").get(0).map(|v| str_at(v, "ip")) == Some(ip),
                "podIPs: {}",
                at(p, "status.podIPs")
            );
        }
        // Probes connect from the Pod's own network (issue 51, finding 6):
        // 127.0.0.1 is the Pod's loopback, where its server answers, and a
        // port only the host's loopback serves is closed there.
        let host_only = std::net::TcpListener::bind("127.0.0.1:0")?;
        host_only.set_nonblocking(true)?;
        let host_only_port = host_only.local_addr()?.port();
        let probed = server_pod("net-probe", None).replace(
            "tcpSocket: {port: 8080}",
            &format!(
                "tcpSocket: {{host: 127.0.0.1, port: 8080}}\n      periodSeconds: 1\n    \
                 livenessProbe:\n      tcpSocket: {{host: 127.0.0.1, port: {host_only_port}}}\n      \
                 failureThreshold: 1000"
            ),
        );
        c.apply(&probed)?;
        ready(c, "net-probe")?;
        let refused = wait_for(
            "the loopback liveness probe to fail",
            Duration::from_secs(30),
            || {
                let m = c.kubectl(&[
                    "get",
                    "events",
                    "-n",
                    NS,
                    "--field-selector",
                    "involvedObject.name=net-probe,reason=Unhealthy",
                    "-o",
                    "jsonpath={.items[*].message}",
                ])?;
                Ok((!m.is_empty()).then_some(m))
            },
        )?;
        ensure!(
            refused.contains(&format!(
                "Liveness probe failed: dial tcp 127.0.0.1:{host_only_port}: connect: connection refused"
            )),
            "{refused}"
        );
        ensure!(
            host_only.accept().is_err(),
            "a probe reached the host's loopback"
        );
        // Both on 8080 (and net-a on 80, as the unprivileged run-as user),
        // each with its own IP in its environment.
        let at_ip =
            |ip: &str, port| std::net::SocketAddr::new(ip.parse().unwrap_or([0u8; 4].into()), port);
        ensure!(read_from(at_ip(ip_a, 8080))? == format!("net-a {ip_a}"));
        ensure!(read_from(at_ip(ip_b, 8080))? == format!("net-b {ip_b}"));
        ensure!(read_from(at_ip(ip_a, 80))? == format!("net-a {ip_a}"));
        // A third Pod reaches both by IP.
        let client = format!(
            "import socket\nfor ip in [{ip_a:?}, {ip_b:?}]:\n    print(socket.create_connection((ip, 8080), 5).recv(100).decode().strip(), flush=True)\n"
        );
        c.apply(&pod(
            "net-c",
            &format!(
                "  restartPolicy: Never\n  containers:\n  - name: client\n    image: python:3\n    args: [\"-c\", {}]",
                serde_json::to_string(&client)?
            ),
        ))?;
        wait_for("net-c to succeed", Duration::from_secs(60), || {
            let p = get(c, "net-c")?;
            let phase = str_at(&p, "status.phase");
            ensure!(phase != "Failed", "net-c failed: {}", at(&p, "status"));
            Ok((phase == "Succeeded").then_some(()))
        })?;
        let logs = c.kubectl(&["logs", "-n", NS, "net-c"])?;
        ensure!(
            logs.contains(&format!("net-a {ip_a}")) && logs.contains(&format!("net-b {ip_b}")),
            "{logs}"
        );
        // A finished Pod's IP is back in the pool, as the kubelet stops its sandbox.
        let ip_c = str_at(&get(c, "net-c")?, "status.podIP").to_owned();
        wait_for("net-c's IP to be released", Duration::from_secs(20), || {
            Ok((!net.reserved().contains(&ip_c)).then_some(()))
        })?;
        // kubectl port-forward reaches the Pod in its own network.
        let local = common::free_port()?;
        let mut fwd = std::process::Command::new(c.env("VKD_E2E_KUBECTL")?)
            .env("KUBECONFIG", c.kubeconfig())
            .args([
                "port-forward",
                "-n",
                NS,
                "pod/net-a",
                &format!("{local}:8080"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let forwarded = wait_for("the port-forward", Duration::from_secs(20), || {
            Ok(read_from(std::net::SocketAddr::from(([127, 0, 0, 1], local))).ok())
        });
        let _ = fwd.kill();
        let _ = fwd.wait();
        ensure!(forwarded? == format!("net-a {ip_a}"));
        // The hostPort, at the host's own address.
        match host_address() {
            Some(h) => ensure!(
                read_from(std::net::SocketAddr::new(h, host_port))? == format!("net-a {ip_a}")
            ),
            None => eprintln!("the host has no address but loopback: hostPort not checked"),
        }
        delete_all(c)?;
        ensure!(
            net.reserved().is_empty(),
            "IPs still held: {:?}",
            net.reserved()
        );
        ensure!(net.namespaces() == 0, "network namespaces left behind");
        Ok(())
    })?
    else {
        return Ok(());
    };
    Ok(())
}

fn twenty_pods_and_a_sigkill(c: &Cluster) -> Result<()> {
    let Some(()) = with_net(c, |net| {
        let yaml: Vec<String> = (0..20)
            .map(|i| {
                pod(
                    &format!("storm-{i}"),
                    "  terminationGracePeriodSeconds: 1\n  containers:\n  - {name: main, image: busybox, command: [sleep, '3603']}",
                )
            })
            .collect();
        c.apply(&yaml.join("\n---\n"))?;
        // SIGKILL while the creates are under way.
        wait_for("a few Pods to have an IP", Duration::from_secs(60), || {
            Ok((net.reserved().len() >= 3).then_some(()))
        })?;
        net.vkd.kill()?;
        net.vkd.spawn()?;
        let pods = wait_for(
            "all 20 Running with an IP",
            Duration::from_secs(120),
            || {
                let list = c.kubectl_json(&["get", "pods", "-n", NS, "-l", "suite=net"])?;
                let pods = items(&list);
                Ok((pods.len() == 20
                    && pods
                        .iter()
                        .all(|p| running_and_ready(p) && !str_at(p, "status.podIP").is_empty()))
                .then_some(pods))
            },
        )?;
        let mut ips: Vec<String> = pods
            .iter()
            .map(|p| str_at(p, "status.podIP").to_owned())
            .collect();
        ips.sort();
        ips.dedup();
        ensure!(ips.len() == 20, "IPs shared between Pods: {ips:?}");
        // Exactly what the Pods hold: nothing leaked by the create that died.
        ensure!(
            net.reserved() == ips,
            "held {:?}, Pods have {ips:?}",
            net.reserved()
        );
        ensure!(
            net.namespaces() == 20,
            "{} network namespaces",
            net.namespaces()
        );
        delete_all(c)?;
        wait_for("every IP back in the pool", Duration::from_secs(30), || {
            Ok((net.reserved().is_empty() && net.namespaces() == 0).then_some(()))
        })?;
        Ok(())
    })?
    else {
        return Ok(());
    };
    Ok(())
}

/// The attacks a hostile tenant tried on a process node with namespaces and
/// a CNI network, each with its Pod spec, through the real kubectl: its own
/// user namespace (`unshare -Urm`) for an exec and an exec probe to enter,
/// a setuid-root program of the host, `PATH` tricks that bound the host's
/// /proc and every Pod's sandbox, and `kubectl debug` reading another Pod's
/// Secret. What the tenant now sees is asserted; a normal Pod still pings.
fn a_tenant_stays_in_its_sandbox(c: &Cluster) -> Result<()> {
    let Some(()) = with_net(c, |net| {
        let state = std::fs::canonicalize(&net.vkd.state_dir)?;
        let pods = state.join("process/pods");
        // A setuid-root `id` on the host, outside /tmp (a container's own).
        let suid_dir =
            std::path::PathBuf::from(format!("/var/tmp/vkd-e2e-suid-{}", std::process::id()));
        std::fs::create_dir_all(&suid_dir)?;
        let suid = suid_dir.join("id");
        let id = ["/usr/bin/id", "/bin/id"]
            .into_iter()
            .find(|p| std::path::Path::new(p).is_file())
            .context("no id on the host")?;
        std::fs::copy(id, &suid)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&suid_dir, std::fs::Permissions::from_mode(0o755))?;
        std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755))?;
        c.apply(&format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: victim-secret, namespace: {NS}}}\nstringData: {{token: s3cr3t-of-the-victim}}\n"
        ))?;
        c.apply(&pod(
            "victim",
            r#"  containers:
  - name: main
    image: busybox
    command: [sleep, "3600"]
    env: [{name: VICTIM_ENV, value: hunter2}]
    volumeMounts: [{name: s, mountPath: /secret}]
  volumes: [{name: s, secret: {secretName: victim-secret}}]"#,
        ))?;
        let script = format!(
            "unshare -Urm sh -c 'echo own-namespace' 2>/dev/null || echo unshare-refused; \
             echo euid=$({suid} -u); \
             echo procs=$(ls /proc | grep -c '^[0-9]'); \
             echo pods=$(ls {pods} 2>/dev/null | wc -l); \
             cat {pods}/*/volumes/s/token 2>/dev/null || echo no-secret; \
             python3 -c \"import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); s.settimeout(5); s.sendto(bytes([8, 0, 0, 0, 0, 1, 0, 1]), ('127.0.0.1', 0)); s.recv(64); print('ping-ok')\" 2>/dev/null || echo ping-failed; \
             echo checked; exec sleep 3600",
            suid = suid.display(),
            pods = pods.display(),
        );
        c.apply(&pod(
            "tenant",
            &format!(
                r#"  containers:
  - name: main
    image: busybox
    command: [sh, -c, {script}]
    env: [{{name: PATH, value: "/tmp/../proc:/tmp/..{pods}:/usr/sbin:/usr/bin:/sbin:/bin"}}]
    securityContext: {{allowPrivilegeEscalation: false, capabilities: {{drop: [ALL]}}}}
    readinessProbe:
      exec: {{command: [sh, -c, "grep -q '^Seccomp:.*2' /proc/self/status && test $(id -u) != 0"]}}
      periodSeconds: 1"#,
                script = serde_json::to_string(&script)?,
                pods = pods.display(),
            ),
        ))?;
        ready(c, "victim")?;
        ready(c, "tenant")?;
        let log = wait_for("the tenant's checks", Duration::from_secs(30), || {
            let l = c.kubectl(&["logs", "-n", NS, "tenant"])?;
            Ok(l.contains("checked").then_some(l))
        })?;
        ensure!(log.contains("unshare-refused"), "{log}");
        ensure!(
            log.contains("euid=65534"),
            "a host setuid program gave: {log}"
        );
        let procs: usize = log
            .lines()
            .find_map(|l| l.strip_prefix("procs="))
            .unwrap_or("999")
            .trim()
            .parse()?;
        ensure!(procs < 10, "the host's /proc is in view: {log}");
        // Not even its own sandbox: a container that saw it could put a
        // link where its volume was (issue 51).
        ensure!(log.contains("pods=0"), "sandboxes in view: {log}");
        ensure!(
            log.contains("no-secret") && !log.contains("s3cr3t"),
            "{log}"
        );
        ensure!(log.contains("ping-ok"), "ping fails in a Pod: {log}");
        // kubectl exec: in the container's namespaces, with its privileges.
        let status = c.kubectl(&["exec", "-n", NS, "tenant", "--", "cat", "/proc/self/status"])?;
        for (field, want) in [
            ("NoNewPrivs", "1"),
            ("CapBnd", "0000000000000000"),
            ("Seccomp", "2"),
        ] {
            let got = status
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{field}:")))
                .unwrap_or("")
                .trim();
            ensure!(got == want, "{field}: {got} in an exec, not {want}");
        }
        let init = c.kubectl(&[
            "exec",
            "-n",
            NS,
            "tenant",
            "--",
            "sh",
            "-c",
            "tr '\\0' ' ' < /proc/1/cmdline",
        ])?;
        ensure!(
            init.trim().ends_with("sleep 3600"),
            "the exec is not in the container's PID namespace: {init}"
        );
        // kubectl debug in the tenant's Pod sees the tenant, never the victim.
        let look = format!(
            "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c hunter2; \
             cat {pods}/*/volumes/s/token 2>/dev/null; \
             echo procs=$(ls /proc | grep -c '^[0-9]'); echo debugged",
            pods = pods.display()
        );
        c.kubectl(&[
            "debug",
            "tenant",
            "-n",
            NS,
            "--image=busybox",
            "--profile=baseline",
            "-c",
            "dbg",
            "--target=main",
            "--",
            "sh",
            "-c",
            &look,
        ])?;
        let dbg = wait_for("the debugger's log", Duration::from_secs(30), || {
            let l = c
                .kubectl(&["logs", "-n", NS, "tenant", "-c", "dbg"])
                .unwrap_or_default();
            Ok(l.contains("debugged").then_some(l))
        })?;
        ensure!(
            dbg.lines().next().map(str::trim) == Some("0"),
            "another Pod's env in view: {dbg}"
        );
        ensure!(!dbg.contains("s3cr3t"), "{dbg}");
        let procs: usize = dbg
            .lines()
            .find_map(|l| l.strip_prefix("procs="))
            .unwrap_or("999")
            .trim()
            .parse()?;
        ensure!(procs < 10, "the debugger sees the host's processes: {dbg}");
        // Host namespaces need --allow-privileged; vkd's own kubelet port is
        // never a Pod's hostPort (the portmap DNAT would sit in front of it),
        // nor is the port of another vkd on the host that is restarting
        // (reserved, though nothing listens on it).
        let kubelet_port = net.vkd.kubelet_port;
        let restarting = common::free_port()?;
        std::fs::write(
            common::host_port_reservations().join(restarting.to_string()),
            "vkd's kubelet API (--kubelet-port), vkd of node vk-restarting\n",
        )?;
        for (name, body, reason) in [
            (
                "host-net",
                "  hostNetwork: true\n  containers:\n  - {name: main, image: busybox, command: [sleep, \"3600\"]}".to_owned(),
                "HostNamespacesNotAllowed",
            ),
            (
                "hijack",
                format!(
                    "  containers:\n  - {{name: main, image: busybox, command: [sleep, \"3600\"], ports: [{{containerPort: 8080, hostPort: {kubelet_port}}}]}}"
                ),
                "HostPortNotAllowed",
            ),
            (
                "hijack-restarting",
                format!(
                    "  containers:\n  - {{name: main, image: busybox, command: [sleep, \"3600\"], ports: [{{containerPort: 8080, hostPort: {restarting}}}]}}"
                ),
                "HostPortNotAllowed",
            ),
        ] {
            c.apply(&pod(name, &body))?;
            wait_for(
                &format!("{name} to fail with {reason}"),
                Duration::from_secs(30),
                || {
                    let p = get(c, name)?;
                    Ok((str_at(&p, "status.phase") == "Failed"
                        && str_at(&p, "status.reason") == reason)
                        .then_some(()))
                },
            )?;
        }
        delete_all(c)?;
        c.kubectl(&["delete", "secret", "-n", NS, "victim-secret"])?;
        let _ = std::fs::remove_dir_all(&suid_dir);
        Ok(())
    })?
    else {
        return Ok(());
    };
    Ok(())
}
