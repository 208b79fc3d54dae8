//! Shared by the e2e suites: a vkd process per test and JSON helpers.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, at, condition, repo_root};

pub mod hpa;

pub const VKD: &str = env!("CARGO_BIN_EXE_vkd");

/// A vkd process for one test; killed when dropped.
pub struct Vkd {
    pub node: String,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    pub kubelet_port: u16,
    pub args: Vec<String>,
    child: Option<Child>,
}

pub use vkd_e2e::free_port;

/// Where the suite's vkds reserve their ports (`--host-port-reservations`).
pub fn host_port_reservations() -> PathBuf {
    std::env::temp_dir().join(format!("vkd-e2e-{}-host-ports", std::process::id()))
}

/// The vkd the suites start: this build, or `VKD_E2E_VKD_BIN` (to measure another
/// build, an older one say, with the same suites).
pub fn daemon_binary() -> PathBuf {
    std::env::var_os("VKD_E2E_VKD_BIN").map_or_else(|| PathBuf::from(VKD), PathBuf::from)
}

impl Vkd {
    pub fn start(c: &Cluster, node: &str, extra: &[&str]) -> Result<Self> {
        Self::start_with_fleet(c, node, "demo.yaml", extra)
    }

    pub fn start_with_fleet(c: &Cluster, node: &str, fleet: &str, extra: &[&str]) -> Result<Self> {
        let fleet = repo_root().join("testdata/fleets").join(fleet);
        Self::start_provider(c, node, "sim", &fleet, extra)
    }

    /// vkd on the process provider, with `testdata/process/e2e.yaml`.
    pub fn start_process(c: &Cluster, node: &str, extra: &[&str]) -> Result<Self> {
        let config = repo_root().join("testdata/process/e2e.yaml");
        Self::start_provider(c, node, "process", &config, extra)
    }

    pub fn start_provider(
        c: &Cluster,
        node: &str,
        provider: &str,
        config: &std::path::Path,
        extra: &[&str],
    ) -> Result<Self> {
        // Processes run as an unprivileged user, who must reach the sandboxes: the
        // process provider's state goes under the temp dir, not the (maybe private) checkout.
        let state_dir = if provider == "process" {
            std::env::temp_dir().join(format!("vkd-e2e-{}-{node}", std::process::id()))
        } else {
            c.dir().join("vkd-state").join(node)
        };
        std::fs::create_dir_all(&state_dir)?;
        let fleet = config;
        let kubelet_port = free_port()?;
        let mut args: Vec<String> = vec!["run".into()];
        if !extra.contains(&"--kubeconfig") {
            // Every e2e vkd runs with the manifests' ServiceAccount and nothing
            // more: the suites together prove the RBAC is enough.
            args.push("--kubeconfig".into());
            args.push(service_account_kubeconfig(c)?.display().to_string());
            args.push("--leader-election-namespace".into());
            args.push("vkd-system".into());
        }
        args.extend([
            "--node-name".into(),
            node.into(),
            "--provider".into(),
            provider.into(),
            "--provider-config".into(),
            fleet.display().to_string(),
            "--state-dir".into(),
            state_dir.display().to_string(),
            "--admin-port".into(),
            free_port()?.to_string(),
            "--kubelet-port".into(),
            kubelet_port.to_string(),
        ]);
        if !extra.contains(&"--host-port-reservations") {
            // The suite's vkds share port reservations as a host's would, in
            // a directory of the suite's: a reservation is never removed, and
            // the suites' random ports must not pile up in the host's own.
            // Under the temp dir, as the process state: it must be root's
            // all the way up, which a checkout may not be.
            args.push("--host-port-reservations".into());
            args.push(host_port_reservations().display().to_string());
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut vkd = Self {
            node: node.into(),
            state_dir,
            log: c.log_path(&format!("vkd-{node}")),
            kubelet_port,
            args,
            child: None,
        };
        vkd.spawn()?;
        Ok(vkd)
    }

    pub fn spawn(&mut self) -> Result<()> {
        let child = vkd_e2e::spawn_logged(
            &daemon_binary(),
            &self.args,
            &self.log,
            "info,kube=warn,vkd::pods::volume_refresh=debug",
        )?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no chance to clean up, as when a node or a container dies.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// The daemon's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The daemon's resident memory.
    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// The sim backend's instances, read from its state directory by `vkd sim list`.
    pub fn instances(&self) -> Result<Vec<Value>> {
        self.instances_on(&self.node)
    }

    /// [`Self::instances`] of one of its Nodes (per-host mode has several).
    pub fn instances_on(&self, node: &str) -> Result<Vec<Value>> {
        sim_instances(&self.state_dir, node)
    }
}

/// What a sim backend whose state is under `state_dir` runs for `node`
/// (`vkd sim list`).
pub fn sim_instances(state_dir: &std::path::Path, node: &str) -> Result<Vec<Value>> {
    let out = Command::new(VKD)
        .args(["sim", "list", "--json", "--node", node, "--state-dir"])
        .arg(state_dir)
        .output()?;
    ensure!(
        out.status.success(),
        "vkd sim list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice::<Value>(&out.stdout)?
        .as_array()
        .cloned()
        .unwrap_or_default())
}

impl Vkd {
    /// The port of its admin server (`/metrics`, `/slices`).
    pub fn admin_port(&self) -> Result<u16> {
        let i = self
            .args
            .iter()
            .position(|a| a == "--admin-port")
            .context("no admin port")?;
        Ok(self.args[i + 1].parse()?)
    }

    /// Kills what the process provider left running (shims and their containers'
    /// process groups) and removes its state; for the end of a suite.
    pub fn reap_processes(&self) {
        let pods = self.state_dir.join("process/pods");
        let Ok(entries) = std::fs::read_dir(&pods) else {
            return;
        };
        for e in entries.flatten() {
            let dir = e.path();
            if let Ok(text) = std::fs::read_to_string(dir.join("shim.pid"))
                && let Some(pid) = text.split_whitespace().next()
            {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            if let Ok(bytes) = std::fs::read(dir.join("status.json"))
                && let Ok(v) = serde_json::from_slice::<Value>(&bytes)
            {
                for list in ["init", "containers"] {
                    for c in at(&v, list).as_array().into_iter().flatten() {
                        if let Some(pid) = c["process"]["pid"].as_i64() {
                            let _ = Command::new("kill")
                                .args(["-9", "--", &format!("-{pid}")])
                                .status();
                        }
                    }
                }
            }
        }
        // The Pods' network namespaces, and the mount point that holds them.
        let netns = self.state_dir.join("process/netns");
        let held: Vec<PathBuf> = std::fs::read_dir(&netns)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .chain([netns.clone()])
            .collect();
        for path in held {
            let _ = Command::new("umount").arg("-l").arg(path).output();
        }
        if self.state_dir.starts_with(std::env::temp_dir()) {
            let _ = std::fs::remove_dir_all(&self.state_dir);
        }
    }
}

impl Drop for Vkd {
    fn drop(&mut self) {
        let _ = self.kill();
        // A test that failed half way leaves no process-provider Pods running.
        self.reap_processes();
    }
}

pub fn items(v: &Value) -> Vec<Value> {
    at(v, "items").as_array().cloned().unwrap_or_default()
}

pub fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path).as_str().unwrap_or_default()
}

pub fn running_and_ready(p: &Value) -> bool {
    at(p, "status.phase") == "Running"
        && condition(p, "Ready").is_some_and(|c| c["status"] == "True")
}

/// See [`Cluster::service_account_kubeconfig`].
pub fn service_account_kubeconfig(c: &Cluster) -> Result<PathBuf> {
    c.service_account_kubeconfig()
}

/// A TCP proxy the test controls: `cut` drops every connection and refuses new
/// ones (a partition between vkd and the API server), `heal` lets them through.
pub struct Proxy {
    pub port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    live: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Proxy {
    pub fn start(upstream: std::net::SocketAddr) -> Result<Self> {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let live: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>> = Default::default();
        let (c, l) = (cut.clone(), live.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if c.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(upstream) else {
                    continue;
                };
                let pairs = [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ];
                if let Ok(mut list) = l.lock() {
                    list.extend(client.try_clone());
                    list.extend(server.try_clone());
                }
                for (from, to) in pairs {
                    if let (Ok(mut from), Ok(mut to)) = (from, to) {
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut from, &mut to);
                            let _ = to.shutdown(std::net::Shutdown::Both);
                        });
                    }
                }
            }
        });
        Ok(Self { port, cut, live })
    }

    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Ok(mut list) = self.live.lock() {
            for s in list.drain(..) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    pub fn heal(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// A copy of the ServiceAccount kubeconfig that reaches the API server through this proxy.
    pub fn kubeconfig(&self, c: &Cluster) -> Result<PathBuf> {
        let text = std::fs::read_to_string(service_account_kubeconfig(c)?)?;
        let server = format!("https://{}", apiserver_addr(c)?);
        ensure!(
            text.contains(&server),
            "the kubeconfig does not name {server}"
        );
        let out = c.dir().join(format!("kubeconfig-proxy-{}", self.port));
        std::fs::write(
            &out,
            text.replace(&server, &format!("https://127.0.0.1:{}", self.port)),
        )?;
        Ok(out)
    }
}

pub fn apiserver_addr(c: &Cluster) -> Result<std::net::SocketAddr> {
    c.apiserver_addr()
}

/// GET from a vkd's admin server; the body.
pub fn admin_get(vkd: &Vkd, path: &str) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let port = vkd.admin_port()?;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((
        code,
        out.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    ))
}

/// One counter or gauge from an admin `/metrics` text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == name).then(|| v.trim().parse().ok())?
    })
}

/// The sim journal of a vkd: (event, podUID, unix ms) in order.
pub fn journal(vkd: &Vkd) -> Result<Vec<(String, String, u64)>> {
    let text = std::fs::read_to_string(vkd.state_dir.join("sim/journal.jsonl")).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line)?;
        out.push((
            str_at(&v, "event").to_owned(),
            str_at(&v, "podUID").to_owned(),
            at(&v, "atMs").as_u64().unwrap_or(0),
        ));
    }
    Ok(out)
}

/// Pod UIDs against instance owners: the backend runs exactly the Pods, once each.
pub fn assert_one_instance_per_pod(vkd: &Vkd, pods: &[Value]) -> Result<()> {
    let instances = vkd.instances()?;
    let owners: Vec<&str> = instances.iter().map(|i| str_at(i, "podUID")).collect();
    let unique: BTreeSet<&str> = owners.iter().copied().collect();
    ensure!(
        unique.len() == owners.len(),
        "duplicate instances for one Pod: {owners:?}"
    );
    let uids: BTreeSet<&str> = pods.iter().map(|p| str_at(p, "metadata.uid")).collect();
    ensure!(unique == uids, "instances {unique:?} != pods {uids:?}");
    for p in pods {
        let uid = str_at(p, "metadata.uid");
        let ann = at(p, "metadata.annotations")
            .get("vkd.io/instance-id")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let inst = instances
            .iter()
            .find(|i| str_at(i, "podUID") == uid)
            .context("no instance")?;
        ensure!(
            ann == str_at(inst, "instance"),
            "pod {uid} names instance {ann:?}, backend has {}",
            inst["instance"]
        );
    }
    Ok(())
}

/// A Pod network for a process node (docs/process-provider.md): builds the
/// standard CNI plugins (`e2e/cluster build-cni`), writes a network list
/// named `name` to `dir/pods.conflist` (a bridge `bridge`, host-local IPs
/// from `subnet` kept in `dir/ipam`, portmap), and returns the provider
/// config's `network:` section for it.
pub fn cni_network(
    dir: &std::path::Path,
    name: &str,
    bridge: &str,
    subnet: &str,
) -> Result<String> {
    let bin = vkd_e2e::built("build-cni")?.display().to_string();
    let conflist = dir.join("pods.conflist");
    std::fs::write(
        &conflist,
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": name,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": bridge,
                    "isGateway": true,
                    "isDefaultGateway": true,
                    "ipMasq": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": subnet}]],
                        "dataDir": dir.join("ipam"),
                    }
                },
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        })
        .to_string(),
    )?;
    Ok(format!(
        "network:\n  cniConfig: {}\n  cniBinDir: {bin}\n",
        conflist.display()
    ))
}

/// A client CA bundle that lets the cluster's users reach a vkd with their
/// own client certificates (as a kubelet trusts the cluster's client CA), for
/// `vkd explain --direct`: its path, for `--client-ca-file`.
pub fn users_client_ca(c: &Cluster) -> Result<String> {
    let bundle = c.dir().join("explain-client-ca.pem");
    if !bundle.exists() {
        let mut pem = std::fs::read_to_string(c.env("VKD_E2E_CA")?)?;
        pem.push_str(&std::fs::read_to_string(
            c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
        )?);
        std::fs::write(&bundle, pem)?;
    }
    Ok(bundle.display().to_string())
}

/// A provider plugin in a process of its own, serving the provider protocol
/// on a Unix socket; killed on drop.
pub struct Plugin {
    bin: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    pub socket: PathBuf,
    child: Option<Child>,
}

impl Plugin {
    /// `vkd provider-serve`: the sim as a plugin, its state beside its socket.
    pub fn sim(c: &Cluster, name: &str) -> Result<Self> {
        let dir = c.dir().join(name);
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("provider.sock");
        let fleet = repo_root().join("testdata/fleets/demo.yaml");
        let args = vec![
            "provider-serve".into(),
            "--provider".into(),
            "sim".into(),
            "--provider-config".into(),
            fleet.display().to_string(),
            "--state-dir".into(),
            dir.display().to_string(),
            "--listen".into(),
            format!("unix://{}", socket.display()),
        ];
        Self::start(c, name, daemon_binary(), args, Vec::new(), socket)
    }

    /// `bin args...`, which is to listen on `socket`; waits until it does.
    pub fn start(
        c: &Cluster,
        name: &str,
        bin: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
        socket: PathBuf,
    ) -> Result<Self> {
        let mut plugin = Self {
            bin,
            args,
            env,
            log: c.log_path(name),
            socket,
            child: None,
        };
        plugin.spawn()?;
        Ok(plugin)
    }

    pub fn spawn(&mut self) -> Result<()> {
        let _ = std::fs::remove_file(&self.socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&self.bin)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        self.child = Some(child);
        vkd_e2e::wait_for(
            "the plugin's socket",
            std::time::Duration::from_secs(20),
            || Ok(self.socket.exists().then_some(())),
        )
    }

    /// SIGKILL, as when the plugin crashes.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// What the plugin's sim runs for `node`, read from its state.
    pub fn instances(&self, node: &str) -> Result<Vec<Value>> {
        let state = self.socket.parent().context("the plugin's directory")?;
        sim_instances(state, node)
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// A binary built beside vkd's (`vkd-slurm`): `cargo test --workspace`
/// builds every package's binaries before any test runs.
pub fn sibling_binary(name: &str) -> Result<PathBuf> {
    let bin = std::path::Path::new(VKD).with_file_name(name);
    ensure!(
        bin.exists(),
        "{} is not built: cargo build -p {name} (cargo test --workspace builds it)",
        bin.display()
    );
    Ok(bin)
}
