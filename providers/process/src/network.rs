//! A network namespace and an IP per Pod, through CNI plugins (the
//! standard ones, or any that follow the CNI spec), where the config names a
//! network (`network` in the provider config) and containers have namespaces.
//!
//! At create the provider makes the Pod's network namespace, kept by a bind
//! mount at `<state>/netns/<uid>`, raises nothing but what a runtime raises in
//! it (unprivileged ports from 0, as the kubelet's runtimes do, so a Pod binds
//! port 80 as its own user), and runs `loopback` and then the configured list
//! with ADD, as containerd does. The first IP of the result is the Pod's IP.
//! Every container's launcher joins the namespace; `kubectl exec`, probes and
//! port-forward reach the Pod there. When the sandbox is removed (the Pod is
//! gone, or vkd finds a half-made or orphaned sandbox after a crash) the list
//! runs DEL and the namespace is unmounted, so the IPAM plugin gets its IP
//! back. What was set up is recorded (`network.json`) before the first plugin
//! runs, so a crash at any point leaves something DEL can be run from.
//!
//! Plugins are programs that can hang (a stuck IPAM lock, a dead DHCP
//! server): each run is bounded (`pluginTimeoutSeconds`), in a process group
//! of its own that is killed whole on expiry, and no plugin ever runs under
//! the node's fence lock, so a stuck one stalls only its own Pod.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

mod netns;

pub use netns::connect_in;
use netns::{keep_apart, make_netns, remove_netns};

/// The reason a Pod's start gets when its network could not be set up: the
/// kubelet's `FailedCreatePodSandBox`, for a runtime's CNI failure, which
/// vkd retries with a back-off.
pub const NETWORK_SETUP_FAILED: &str = vkd_provider::SANDBOX_NOT_CREATED;
/// The name of the Pod's interface in its namespace.
pub const INTERFACE: &str = "eth0";
/// How long one plugin may run, where a record says nothing (one from
/// before `pluginTimeoutSeconds`).
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(60);
/// The most of a plugin's error output a message carries: it ends up in the
/// Pod's status and an Event, which must stay small.
const MESSAGE_MAX: usize = 1024;
/// What the plugins find on PATH (portmap and bridge run iptables).
const PLUGIN_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("network.cniConfig {path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("the Pod's network namespace {path}: {source}")]
    Namespace {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CNI plugin {plugin} ({command}): {message}")]
    Plugin {
        plugin: String,
        command: &'static str,
        message: String,
    },
}

type Result<T> = std::result::Result<T, NetworkError>;

/// The network configuration list, checked at start.
#[derive(Clone, Debug)]
pub struct Network {
    /// The list as read (`cniVersion`, `name`, `plugins`).
    list: Value,
    bin_dir: PathBuf,
    /// Where the Pods' namespaces are kept: `<state>/netns`.
    netns_dir: PathBuf,
    /// How long one plugin run may take.
    timeout: Duration,
}

impl Network {
    /// Reads and checks the list: valid JSON with a name, a version and
    /// plugins, each a program in `bin_dir`, as `loopback` must be.
    pub fn load(config: &crate::config::NetworkConfig, state: &Path) -> Result<Self> {
        let path = &config.cni_config;
        let bad = |message: String| NetworkError::Config {
            path: path.clone(),
            message,
        };
        let text = crate::config::read_regular(path, crate::config::MAX_FILE_BYTES)
            .map_err(|e| bad(e.to_string()))?;
        let list: Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        for key in ["cniVersion", "name"] {
            if !list.get(key).is_some_and(Value::is_string) {
                return Err(bad(format!("{key} must be a string")));
            }
        }
        let plugins = list
            .get("plugins")
            .and_then(Value::as_array)
            .filter(|p| !p.is_empty())
            .ok_or_else(|| bad("plugins must be a non-empty list (a .conflist)".into()))?;
        let mut types: Vec<&str> = vec!["loopback"];
        for (i, p) in plugins.iter().enumerate() {
            types.push(
                p.get("type")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("plugins[{i}].type must be a string")))?,
            );
        }
        if let Some(t) = types.iter().find(|t| {
            t.is_empty()
                || t.starts_with('.')
                || !t
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        }) {
            return Err(bad(format!(
                "plugin type {t:?} is not a plain program name"
            )));
        }
        for t in types {
            if !is_executable(&config.cni_bin_dir.join(t)) {
                return Err(bad(format!(
                    "plugin {t} is not an executable in cniBinDir {}",
                    config.cni_bin_dir.display()
                )));
            }
        }
        let netns_dir = state.join("netns");
        keep_apart(&netns_dir).map_err(|source| NetworkError::Namespace {
            path: netns_dir.clone(),
            source,
        })?;
        Ok(Self {
            list,
            bin_dir: config.cni_bin_dir.clone(),
            netns_dir,
            timeout: config.plugin_timeout(),
        })
    }

    /// The list's name (`name`), for the Node's annotations and logs.
    pub fn name(&self) -> &str {
        self.list.get("name").and_then(Value::as_str).unwrap_or("")
    }

    /// The directory holding every Pod's namespace: a mount point of its own,
    /// which a container's mount namespace detaches, so that no container
    /// holds another Pod's network namespace alive.
    pub fn netns_dir(&self) -> &Path {
        &self.netns_dir
    }

    /// What Pod `pod` gets, with its `hostPort`s.
    pub fn attachment(
        &self,
        pod: &vkd_provider::PodRef,
        host_ports: &[vkd_provider::HostPort],
    ) -> Attachment {
        Attachment {
            list: self.list.clone(),
            bin_dir: self.bin_dir.clone(),
            netns: self.netns_dir.join(&pod.uid),
            container_id: pod.uid.clone(),
            // The kubelet's CNI_ARGS; names and namespaces are DNS labels, so
            // they hold no `;` or `=`.
            args: format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
                pod.namespace, pod.name, pod.uid, pod.uid
            ),
            port_mappings: host_ports.to_vec(),
            ip: None,
            timeout_secs: self.timeout.as_secs(),
        }
    }
}

/// One Pod's network: everything DEL needs, recorded before ADD runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attachment {
    list: Value,
    bin_dir: PathBuf,
    /// The bind mount that keeps the namespace.
    pub netns: PathBuf,
    container_id: String,
    args: String,
    port_mappings: Vec<vkd_provider::HostPort>,
    /// The Pod's IP, once ADD gave one.
    #[serde(default)]
    pub ip: Option<String>,
    /// How long one plugin run may take (`pluginTimeoutSeconds`).
    #[serde(default = "default_timeout_secs")]
    timeout_secs: u64,
}

fn default_timeout_secs() -> u64 {
    PLUGIN_TIMEOUT.as_secs()
}

impl Attachment {
    /// The `hostPort`s the Pod asked for.
    pub fn host_ports(&self) -> &[vkd_provider::HostPort] {
        &self.port_mappings
    }

    /// The Pod's UID (the CNI container ID).
    pub fn pod_uid(&self) -> &str {
        &self.container_id
    }

    /// Makes the namespace and runs ADD; returns the Pod's IP.
    pub fn add(&self) -> Result<String> {
        make_netns(&self.netns)?;
        let loopback = json!({
            "cniVersion": self.list.get("cniVersion").cloned().unwrap_or(Value::Null),
            "name": "cni-loopback",
            "type": "loopback",
        });
        self.exec("ADD", &loopback, "lo")?;
        let mut prev: Option<Value> = None;
        for i in 0..self.plugin_count() {
            let conf = self.plugin_conf(i, prev.as_ref());
            let out = self.exec("ADD", &conf, INTERFACE)?;
            prev = Some(out);
        }
        let result = prev.unwrap_or(Value::Null);
        pod_ip(&result).ok_or_else(|| NetworkError::Plugin {
            plugin: self.plugin_type(self.plugin_count().saturating_sub(1)),
            command: "ADD",
            message: format!("the result names no IP: {}", bounded(&result.to_string())),
        })
    }

    /// Runs DEL (last plugin first; each tolerates what is already gone, as
    /// the spec asks) and removes the namespace. Safe to repeat.
    pub fn del(&self) -> Result<()> {
        for i in (0..self.plugin_count()).rev() {
            let conf = self.plugin_conf(i, None);
            self.exec("DEL", &conf, INTERFACE)?;
        }
        remove_netns(&self.netns)
    }

    fn plugin_count(&self) -> usize {
        self.list
            .get("plugins")
            .and_then(Value::as_array)
            .map_or(0, Vec::len)
    }

    fn plugin_type(&self, i: usize) -> String {
        self.list["plugins"][i]["type"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }

    /// Plugin `i`'s own config, as libcni builds it: the list's name and
    /// version, the previous plugin's result, and the runtime's values for
    /// the capabilities it declares (here `portMappings`).
    fn plugin_conf(&self, i: usize, prev: Option<&Value>) -> Value {
        let mut conf = self.list["plugins"][i].clone();
        if let Some(obj) = conf.as_object_mut() {
            obj.insert("cniVersion".into(), self.list["cniVersion"].clone());
            obj.insert("name".into(), self.list["name"].clone());
            if let Some(p) = prev {
                obj.insert("prevResult".into(), p.clone());
            }
            let wants_ports = obj
                .get("capabilities")
                .and_then(|c| c.get("portMappings"))
                .and_then(Value::as_bool)
                == Some(true);
            if wants_ports && !self.port_mappings.is_empty() {
                let mappings: Vec<Value> = self
                    .port_mappings
                    .iter()
                    .map(|m| {
                        let mut v = json!({
                            "hostPort": m.host_port,
                            "containerPort": m.container_port,
                            "protocol": m.protocol.to_ascii_lowercase(),
                        });
                        if let Some(ip) = &m.host_ip {
                            v["hostIP"] = json!(ip);
                        }
                        v
                    })
                    .collect();
                obj.insert("runtimeConfig".into(), json!({ "portMappings": mappings }));
            }
        }
        conf
    }

    /// Runs one plugin with `conf` on its stdin; its result (ADD) or null.
    fn exec(&self, command: &'static str, conf: &Value, ifname: &str) -> Result<Value> {
        let plugin = conf.get("type").and_then(Value::as_str).unwrap_or("");
        let fail = |message: String| NetworkError::Plugin {
            plugin: plugin.to_owned(),
            command,
            message,
        };
        // DEL of a namespace already gone passes none, as the spec allows.
        let netns = if command == "DEL" && !self.netns.exists() {
            String::new()
        } else {
            self.netns.display().to_string()
        };
        let mut cmd = std::process::Command::new(self.bin_dir.join(plugin));
        cmd.env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &self.container_id)
            .env("CNI_NETNS", netns)
            .env("CNI_IFNAME", ifname)
            .env("CNI_ARGS", &self.args)
            .env("CNI_PATH", &self.bin_dir)
            .env("PATH", PLUGIN_PATH);
        let input = serde_json::to_vec(conf).map_err(|e| fail(e.to_string()))?;
        let timeout = Duration::from_secs(self.timeout_secs.max(1));
        let run = run_bounded(cmd, input, timeout).map_err(|e| fail(e.to_string()))?;
        let (status, stdout, stderr) = match run {
            Run::Exited {
                status,
                stdout,
                stderr,
            } => (status, stdout, stderr),
            Run::TimedOut => {
                return Err(fail(format!(
                    "did not finish in {}s (pluginTimeoutSeconds); killed",
                    timeout.as_secs()
                )));
            }
        };
        if !status.success() {
            // A failing plugin prints {"code", "msg", "details"} on stdout.
            let why = serde_json::from_slice::<Value>(&stdout)
                .ok()
                .and_then(|v| {
                    let msg = v.get("msg")?.as_str()?.to_owned();
                    Some(match v.get("details").and_then(Value::as_str) {
                        Some(d) if !d.is_empty() => format!("{msg}: {d}"),
                        _ => msg,
                    })
                })
                .unwrap_or_else(|| {
                    String::from_utf8_lossy(if stderr.is_empty() { &stdout } else { &stderr })
                        .into_owned()
                });
            return Err(fail(format!("{status}: {}", bounded(&why))));
        }
        if command != "ADD" || stdout.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&stdout).map_err(|e| fail(format!("its result is not JSON: {e}")))
    }
}

/// How a bounded plugin run ended.
#[derive(Debug)]
enum Run {
    Exited {
        status: std::process::ExitStatus,
        stdout: Vec<u8>,
        stderr: Vec<u8>,
    },
    /// It ran past the bound: its process group was killed.
    TimedOut,
}

/// Runs `cmd` with `input` on its stdin, in a process group of its own, for
/// `timeout` at most: on expiry the whole group (the plugin and whatever it
/// started) is killed. The pipes are fed and drained on threads of their own,
/// so a plugin that neither reads its input nor stops writing cannot stall
/// the wait, and output left open by something the plugin started in the
/// background is given up on at the deadline. At most 1 MiB of each stream
/// is kept.
fn run_bounded(
    mut cmd: std::process::Command,
    input: Vec<u8>,
    timeout: Duration,
) -> std::io::Result<Run> {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    let deadline = Instant::now() + timeout;
    let mut child = cmd
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let group = rustix::process::Pid::from_raw(child.id() as i32);
    let kill_group = || {
        if let Some(g) = group {
            let _ = rustix::process::kill_process_group(g, rustix::process::Signal::KILL);
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        // Ends with the plugin: its exit closes the pipe (EPIPE, not SIGPIPE,
        // which Rust programs ignore).
        std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
    }
    let drain = |r: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(r) = r {
                let _ = r.take(1 << 20).read_to_end(&mut buf);
            }
            let _ = tx.send(buf);
        });
        rx
    };
    let out = drain(child.stdout.take().map(|s| Box::new(s) as _));
    let err = drain(child.stderr.take().map(|s| Box::new(s) as _));
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if Instant::now() >= deadline {
            kill_group();
            let _ = child.wait();
            return Ok(Run::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let collect = |rx: &std::sync::mpsc::Receiver<Vec<u8>>| {
        let left = deadline.saturating_duration_since(Instant::now());
        rx.recv_timeout(left).ok()
    };
    let (stdout, stderr) = match (collect(&out), collect(&err)) {
        (Some(o), Some(e)) => (o, e),
        // Something the plugin left behind holds its output open.
        _ => {
            kill_group();
            return Ok(Run::TimedOut);
        }
    };
    Ok(Run::Exited {
        status,
        stdout,
        stderr,
    })
}

/// `text` on one line, cut to [`MESSAGE_MAX`] bytes.
fn bounded(text: &str) -> String {
    let line: String = text
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if line.len() <= MESSAGE_MAX {
        return line;
    }
    let mut end = MESSAGE_MAX;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &line[..end], line.len())
}

/// Where a sandbox records its Pod's network.
pub fn record_path(sandbox: &Path) -> PathBuf {
    sandbox.join("network.json")
}

/// The network recorded in sandbox directory `sandbox`, if it has one.
pub fn attachment_of(sandbox: &Path) -> std::io::Result<Option<Attachment>> {
    crate::sandbox::read_json(&record_path(sandbox))
}

/// Records `a` in `sandbox` (root's alone: it names the host's plugins).
pub fn record(sandbox: &Path, a: &Attachment) -> std::io::Result<()> {
    crate::sandbox::write_json(&record_path(sandbox), a, 0o600)
}

/// Gives back what sandbox `sandbox` holds of the network (DEL, then the
/// namespace), and forgets it; nothing when it has none.
pub fn release(sandbox: &Path) -> std::result::Result<(), String> {
    let a = match attachment_of(sandbox) {
        Ok(Some(a)) => a,
        Ok(None) => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", record_path(sandbox).display())),
    };
    a.del().map_err(|e| e.to_string())?;
    match std::fs::remove_file(record_path(sandbox)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("{}: {e}", record_path(sandbox).display())),
    }
}

/// The Pod's IP from an ADD result: its first IPv4 address, else its first.
fn pod_ip(result: &Value) -> Option<String> {
    let ips: Vec<std::net::IpAddr> = result
        .get("ips")?
        .as_array()?
        .iter()
        .filter_map(|ip| ip.get("address")?.as_str()?.split('/').next()?.parse().ok())
        .collect();
    ips.iter()
        .find(|ip| ip.is_ipv4())
        .or(ips.first())
        .map(ToString::to_string)
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pod_ip_is_the_first_ipv4_of_the_result() {
        let r = json!({"ips": [
            {"address": "fd00::5/64"},
            {"address": "10.1.2.3/24", "gateway": "10.1.2.1"}
        ]});
        assert_eq!(pod_ip(&r).as_deref(), Some("10.1.2.3"));
        let v6 = json!({"ips": [{"address": "fd00::5/64"}]});
        assert_eq!(pod_ip(&v6).as_deref(), Some("fd00::5"));
        assert_eq!(pod_ip(&json!({"ips": []})), None);
        assert_eq!(pod_ip(&json!({"ips": [{"address": "nonsense"}]})), None);
        assert_eq!(pod_ip(&json!("x")), None);
    }

    fn attachment(ports: Vec<vkd_provider::HostPort>) -> Attachment {
        Attachment {
            list: json!({"cniVersion": "1.0.0", "name": "pods", "plugins": [
                {"type": "bridge", "bridge": "cni0"},
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]}),
            bin_dir: "/opt/cni/bin".into(),
            netns: "/x".into(),
            container_id: "u".into(),
            args: String::new(),
            port_mappings: ports,
            ip: None,
            timeout_secs: 60,
        }
    }

    #[test]
    fn each_plugin_gets_the_lists_name_the_previous_result_and_its_capabilities() {
        let a = attachment(vec![vkd_provider::HostPort {
            container_port: 8080,
            host_port: 30080,
            protocol: "TCP".into(),
            host_ip: None,
        }]);
        let prev = json!({"ips": [{"address": "10.0.0.2/24"}]});
        let bridge = a.plugin_conf(0, None);
        assert_eq!(bridge["name"], "pods");
        assert_eq!(bridge["cniVersion"], "1.0.0");
        assert!(bridge.get("runtimeConfig").is_none() && bridge.get("prevResult").is_none());
        let portmap = a.plugin_conf(1, Some(&prev));
        assert_eq!(portmap["prevResult"], prev);
        assert_eq!(
            portmap["runtimeConfig"]["portMappings"],
            json!([{"hostPort": 30080, "containerPort": 8080, "protocol": "tcp"}])
        );
        assert!(
            attachment(Vec::new())
                .plugin_conf(1, None)
                .get("runtimeConfig")
                .is_none()
        );
    }

    #[test]
    fn a_bad_list_is_refused_naming_what_is_wrong() {
        let dir = std::env::temp_dir().join(format!("vkd-cni-{}", std::process::id()));
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let conf = dir.join("pods.conflist");
        let load = |text: &str| {
            std::fs::write(&conf, text).unwrap();
            Network::load(
                &crate::config::NetworkConfig {
                    cni_config: conf.clone(),
                    cni_bin_dir: bin.clone(),
                    plugin_timeout_seconds: None,
                },
                &dir,
            )
            .map(|_| ())
            .unwrap_err()
            .to_string()
        };
        assert!(load("{").contains("not JSON"));
        assert!(load(r#"{"cniVersion":"1.0.0","name":"p","type":"bridge"}"#).contains("plugins"));
        let e = load(r#"{"cniVersion":"1.0.0","name":"p","plugins":[{"type":"../sh"}]}"#);
        assert!(e.contains("not a plain program name"), "{e}");
        let e = load(r#"{"cniVersion":"1.0.0","name":"p","plugins":[{"type":"bridge"}]}"#);
        assert!(e.contains("loopback is not an executable"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `cniConfig` is read as the config is: a FIFO, a device or an oversized
    /// file is a config error naming the field, never a hang or a huge read.
    #[test]
    fn the_list_must_be_a_regular_file_of_bounded_size() {
        let dir = std::env::temp_dir().join(format!("vkd-cni-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.conflist");
        let _ = std::fs::remove_file(&fifo);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let big = dir.join("big.conflist");
        std::fs::write(&big, " ".repeat(crate::config::MAX_FILE_BYTES as usize + 1)).unwrap();
        for (path, what) in [
            (fifo, "FIFO"),
            (PathBuf::from("/dev/zero"), "character device"),
            (big, "larger than"),
        ] {
            let state = dir.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            let p = path.clone();
            std::thread::spawn(move || {
                let config = crate::config::NetworkConfig {
                    cni_config: p,
                    cni_bin_dir: "/nonexistent".into(),
                    plugin_timeout_seconds: None,
                };
                let _ = tx.send(Network::load(&config, &state).map(|_| ()));
            });
            let e = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("reading the list hung")
                .unwrap_err();
            assert!(matches!(e, NetworkError::Config { .. }), "{e}");
            let e = e.to_string();
            assert!(
                e.contains("network.cniConfig") && e.contains(&path.display().to_string()),
                "{e}"
            );
            assert!(e.contains(what), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
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

    /// Whether process `pid` is gone (or only a zombie).
    fn gone(pid: &str) -> bool {
        (0..200).any(|_| {
            let ended = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |st| {
                st.rsplit_once(") ")
                    .is_some_and(|(_, r)| r.starts_with('Z'))
            });
            if !ended {
                std::thread::sleep(Duration::from_millis(10));
            }
            ended
        })
    }

    /// A plugin that hangs, or leaves something holding its output open, is
    /// killed with all it started once its time is up; the wait never
    /// outlasts the bound.
    #[test]
    fn a_hung_plugin_is_killed_with_what_it_started() {
        let dir = std::env::temp_dir().join(format!("vkd-cni-hang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pids = dir.join("pids");
        for (name, body) in [
            // Hangs, with a child of its own.
            (
                "hang",
                "[ \"$CNI_COMMAND\" = VERSION ] && exit 0\nsleep 1000 & echo $! > \"$PIDS\"\nsleep 1000\n",
            ),
            // Exits at once, but leaves a child holding its stdout.
            (
                "leak",
                "[ \"$CNI_COMMAND\" = VERSION ] && exit 0\nsleep 1000 & echo $! > \"$PIDS\"\necho '{}'\n",
            ),
        ] {
            let exe = dir.join(name);
            script(&exe, body);
            let _ = std::fs::remove_file(&pids);
            let mut cmd = std::process::Command::new(&exe);
            cmd.env("PIDS", &pids);
            let t = Instant::now();
            let run = run_bounded(cmd, b"{}".to_vec(), Duration::from_millis(500)).unwrap();
            assert!(matches!(run, Run::TimedOut), "{name}: {run:?}");
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "{name}: {:?}",
                t.elapsed()
            );
            let child = std::fs::read_to_string(&pids).unwrap();
            assert!(gone(child.trim()), "{name}: its child {child} outlived it");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A failing plugin's error names it and carries its output, cut short:
    /// it ends up in the Pod's status.
    #[test]
    fn a_plugin_error_names_the_plugin_and_is_bounded() {
        let dir = std::env::temp_dir().join(format!("vkd-cni-err-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        script(
            &dir.join("noisy"),
            "[ \"$CNI_COMMAND\" = VERSION ] && exit 0\ncat >/dev/null\n\
             printf 'no IP left in range %s ' $(seq 1 20000) >&2\nexit 1\n",
        );
        let mut a = attachment(Vec::new());
        a.bin_dir = dir.clone();
        let e = a
            .exec("DEL", &json!({"type": "noisy"}), INTERFACE)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "CNI plugin noisy (DEL): exit status: 1: no IP left in range 1 no IP left in range 2"
            ),
            "{e}"
        );
        assert!(e.len() < MESSAGE_MAX + 200, "{} bytes", e.len());
        assert!(!e.contains('\n'));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
