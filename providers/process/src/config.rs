//! The process provider's config file (`--provider-config`, YAML).
//!
//! ```yaml
//! images:                       # which images may run, and as what
//!   - match: "python:3*"        # exact name, or a prefix ending in *
//!     path: /usr/bin:/bin       # where the command is looked up (default: the usual system PATH)
//!     entrypoint: [python3]     # the image's ENTRYPOINT: used when the container gives no command
//!     args: [-V]                # the image's CMD: used when the container gives neither command nor args
//!     files:                    # with namespaces: the image's own files, by their path in the
//!       /etc/app.crt: /srv/app/app.crt  #   container, shown read-only from these host paths
//! runAsUser: 65534              # default 65534; never 0: vkd (root) must not share its uid with Pods
//! runAsGroup: 65534
//! logMaxBytes: 10485760         # per container log file, before rotation
//! maxPods: 110
//! podPidsLimit: 1024            # processes per Pod (the kubelet's podPidsLimit); 0: no limit;
//!                               # set here, also RLIMIT_NPROC where the cgroup has no pids controller
//! cgroupParent: auto            # auto | none | a cgroup v2 directory vkd may create children in
//! isolation: auto               # auto | namespaces | host
//! hostRootReadOnly: true        # with namespaces: the host's tree is read-only in containers
//! network:                      # a network namespace and IP per Pod, through CNI (needs namespaces)
//!   cniConfig: /etc/vkd/cni/pods.conflist   # a CNI network configuration list (JSON)
//!   cniBinDir: /opt/cni/bin     # its plugins, and `loopback`
//!   pluginTimeoutSeconds: 60    # how long one plugin run (ADD or DEL) may take
//! hostPorts:                    # with network: the hostPorts Pods may be given (default: none)
//!   allowed: ["30000-32767", 8080]  # ports and inclusive ranges, 1-65535
//! ```
//!
//! The config file and the files it names that vkd reads (`cniConfig`) must
//! be regular files of at most [`MAX_FILE_BYTES`]: see [`read_regular`].

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The most vkd reads of the config file or of a file it names: far above
/// any real config, and a bound on what a wrong path (a log, a device) costs.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Reads the file at `path`, which must be a regular file of at most `limit`
/// bytes. It is opened without blocking (a FIFO would otherwise wait for a
/// writer, and vkd with it) and checked on the opened handle, so what is read
/// is what was checked; a device such as `/dev/zero` is refused, never read
/// until memory runs out. Links are followed: configs are often links (a
/// ConfigMap's files, /etc/alternatives).
pub fn read_regular(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let meta = f.metadata()?;
    let t = meta.file_type();
    if !t.is_file() {
        let kind = if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else if t.is_socket() {
            "a socket"
        } else if t.is_dir() {
            "a directory"
        } else {
            "not a plain file"
        };
        return Err(invalid(format!("not a regular file ({kind})")));
    }
    let too_big = || invalid(format!("larger than the {limit} bytes allowed"));
    if meta.len() > limit {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    // One byte past the bound: a file that grew since fstat is caught too.
    f.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_big());
    }
    Ok(bytes)
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ImageMap {
    #[serde(rename = "match")]
    pub pattern: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// The image's default arguments (its CMD).
    #[serde(default)]
    pub args: Vec<String>,
    /// The image's own files and directories, by their absolute path in the
    /// container, as host paths: with namespaces each is bound there,
    /// read-only (a program of the image may be one of them). Without
    /// namespaces a container sees the host's tree and none of them.
    #[serde(default)]
    pub files: std::collections::BTreeMap<PathBuf, PathBuf>,
}

impl ImageMap {
    pub fn matches(&self, image: &str) -> bool {
        match self.pattern.strip_suffix('*') {
            Some(prefix) => image.starts_with(prefix),
            None => self.pattern == image,
        }
    }

    pub fn search_path(&self) -> &str {
        self.path.as_deref().unwrap_or(DEFAULT_PATH)
    }

    /// What a container runs, as a container runtime combines the image's
    /// ENTRYPOINT and CMD with the Pod's `command` and `args`: a `command`
    /// replaces the entrypoint and drops the default args; `args` alone
    /// replace the default args.
    pub fn argv(&self, command: &[String], args: &[String]) -> Vec<String> {
        let (program, args) = match (command.is_empty(), args.is_empty()) {
            (false, _) => (command, args),
            (true, false) => (self.entrypoint.as_slice(), args),
            (true, true) => (self.entrypoint.as_slice(), self.args.as_slice()),
        };
        program.iter().chain(args).cloned().collect()
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProcessConfig {
    #[serde(default)]
    pub images: Vec<ImageMap>,
    #[serde(default)]
    pub run_as_user: Option<u32>,
    #[serde(default)]
    pub run_as_group: Option<u32>,
    #[serde(default = "default_log_max")]
    pub log_max_bytes: u64,
    #[serde(default = "default_max_pods")]
    pub max_pods: u32,
    #[serde(default = "default_cgroup")]
    pub cgroup_parent: String,
    /// Processes per Pod: `pids.max` of the Pod's cgroup (default 1024). Set
    /// explicitly, it also applies as RLIMIT_NPROC where there is no pids
    /// controller; that counts every task of the run-as user on the host, so it
    /// is never applied by default.
    #[serde(default)]
    pub pod_pids_limit: Option<u64>,
    /// Containers in namespaces of their own (`namespaces`), as host
    /// processes (`host`), or namespaces where vkd may make them (`auto`).
    #[serde(default)]
    pub isolation: IsolationMode,
    /// With namespaces: the host's tree is read-only in containers.
    #[serde(default = "yes")]
    pub host_root_read_only: bool,
    /// Pods get network namespaces of their own, set up by CNI plugins;
    /// without it they share the host's network.
    #[serde(default)]
    pub network: Option<NetworkConfig>,
    /// The host's GPUs Pods may be given, one each (docs/process-provider.md).
    /// A Pod gets the ones vkd placed it on as `CUDA_VISIBLE_DEVICES` and
    /// `NVIDIA_VISIBLE_DEVICES`; a Pod without GPUs gets none.
    #[serde(default)]
    pub gpus: Vec<GpuConfig>,
    /// Which `hostPort`s Pods may be given (with `network`, where each is a
    /// DNAT rule on the host): none unless listed, as Pod Security's
    /// baseline asks of a node that allows any.
    #[serde(default)]
    pub host_ports: HostPortsConfig,
}

/// `hostPorts` in the config.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HostPortsConfig {
    /// The ports and ranges a Pod's `hostPort` may be; empty: none.
    #[serde(default)]
    pub allowed: Vec<PortRange>,
    /// Where every vkd on the host reserves the ports it serves
    /// ([`crate::hostport::Reservations`]): vkd's `--host-port-reservations`,
    /// not this file, so that every vkd on the host names the same place.
    #[serde(skip, default = "default_reservations")]
    pub reservations: PathBuf,
}

fn default_reservations() -> PathBuf {
    PathBuf::from(crate::hostport::DEFAULT_RESERVATIONS)
}

impl Default for HostPortsConfig {
    fn default() -> Self {
        Self {
            allowed: Vec::new(),
            reservations: default_reservations(),
        }
    }
}

impl HostPortsConfig {
    /// Whether `port` is one the config allows.
    pub fn allows(&self, port: u16) -> bool {
        self.allowed.iter().any(|r| r.contains(port))
    }
}

/// One entry of `hostPorts.allowed`: a port (`8080`) or an inclusive range
/// (`"30000-32767"`), within 1-65535.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "PortRangeText")]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// A `hostPorts.allowed` entry as written: a number or a string.
#[derive(Deserialize)]
#[serde(untagged)]
enum PortRangeText {
    Port(i64),
    Text(String),
}

impl TryFrom<PortRangeText> for PortRange {
    type Error = String;

    fn try_from(t: PortRangeText) -> Result<Self, String> {
        let port = |n: i64| {
            u16::try_from(n)
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("port {n} is not in 1-65535"))
        };
        let number = |s: &str| {
            s.trim()
                .parse::<i64>()
                .map_err(|_| format!("{s:?} is not a port or a range like \"30000-32767\""))
                .and_then(port)
        };
        let (first, last) = match t {
            PortRangeText::Port(n) => (port(n)?, port(n)?),
            PortRangeText::Text(s) => match s.split_once('-') {
                Some((a, b)) => (number(a)?, number(b)?),
                None => (number(&s)?, number(&s)?),
            },
        };
        if first > last {
            return Err(format!("range {first}-{last} ends before it starts"));
        }
        Ok(Self { first, last })
    }
}

/// One entry of `gpus`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuConfig {
    /// What the driver calls it in `CUDA_VISIBLE_DEVICES`: an index or a
    /// UUID (`nvidia-smi -L`).
    pub id: String,
    pub model: String,
    /// Its memory, as a quantity (`80Gi`).
    pub memory: String,
    #[serde(default)]
    pub nvlink_domain: Option<String>,
    #[serde(default)]
    pub numa_node: Option<u32>,
    #[serde(default)]
    pub pcie_root: Option<String>,
}

/// Whether `id` can stand in a `CUDA_VISIBLE_DEVICES` list as it is.
fn plain_gpu_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// `network` in the config.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NetworkConfig {
    /// A CNI network configuration list (`.conflist`), read at start.
    pub cni_config: PathBuf,
    /// Where the plugins it names are, with `loopback`.
    pub cni_bin_dir: PathBuf,
    /// How long one plugin run may take before it is killed and the Pod's
    /// create (or deletion) fails with that; default 60.
    #[serde(default)]
    pub plugin_timeout_seconds: Option<u64>,
}

/// The longest `pluginTimeoutSeconds`: an hour is already no bound at all.
const MAX_PLUGIN_TIMEOUT: u64 = 3600;

impl NetworkConfig {
    /// How long one plugin run may take.
    pub fn plugin_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.plugin_timeout_seconds.unwrap_or(60))
    }
}

/// `isolation` in the config.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IsolationMode {
    #[default]
    Auto,
    Namespaces,
    Host,
}

fn yes() -> bool {
    true
}

fn default_log_max() -> u64 {
    10 << 20
}
fn default_max_pods() -> u32 {
    110
}
fn default_cgroup() -> String {
    "auto".into()
}
const DEFAULT_POD_PIDS: u64 = 1024;

impl Default for ProcessConfig {
    fn default() -> Self {
        Self {
            images: Vec::new(),
            run_as_user: None,
            run_as_group: None,
            log_max_bytes: default_log_max(),
            max_pods: default_max_pods(),
            cgroup_parent: default_cgroup(),
            pod_pids_limit: None,
            isolation: IsolationMode::Auto,
            host_root_read_only: true,
            network: None,
            gpus: Vec::new(),
            host_ports: HostPortsConfig::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl ProcessConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = read_regular(path, MAX_FILE_BYTES).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let cfg: Self = serde_yaml_ng::from_slice(&text).map_err(|e| ConfigError::Invalid {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        for (i, m) in cfg.images.iter().enumerate() {
            if m.pattern.is_empty() {
                return Err(ConfigError::Invalid {
                    path: path.to_owned(),
                    message: format!("images[{i}].match is empty"),
                });
            }
            for (at, source) in &m.files {
                let plain = |p: &Path| {
                    p.is_absolute()
                        && p.parent().is_some()
                        && p.components().all(|c| {
                            matches!(
                                c,
                                std::path::Component::RootDir | std::path::Component::Normal(_)
                            )
                        })
                };
                if !plain(at) || !plain(source) {
                    return Err(ConfigError::Invalid {
                        path: path.to_owned(),
                        message: format!(
                            "images[{i}].files: {} -> {}: both must be absolute paths below / \
                             without . or ..",
                            at.display(),
                            source.display()
                        ),
                    });
                }
                if let Err(e) = source.symlink_metadata() {
                    return Err(ConfigError::Invalid {
                        path: path.to_owned(),
                        message: format!("images[{i}].files: {}: {e}", source.display()),
                    });
                }
            }
        }
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        };
        if cfg.run_as_user == Some(0) || cfg.run_as_group == Some(0) {
            return Err(invalid(
                "runAsUser or runAsGroup 0 would run Pods as root, whom vkd runs as; Pods must \
                 never share vkd's identity (they could read its credentials and state)"
                    .into(),
            ));
        }
        if !matches!(cfg.cgroup_parent.as_str(), "auto" | "none") {
            crate::cgroup::validate(Path::new(&cfg.cgroup_parent))
                .map_err(|e| invalid(format!("cgroupParent: {e}")))?;
        }
        if let Some(n) = &cfg.network
            && !(1..=MAX_PLUGIN_TIMEOUT).contains(&n.plugin_timeout_seconds.unwrap_or(60))
        {
            return Err(invalid(format!(
                "network.pluginTimeoutSeconds must be between 1 and {MAX_PLUGIN_TIMEOUT}"
            )));
        }
        let mut ids = std::collections::BTreeSet::new();
        for (i, g) in cfg.gpus.iter().enumerate() {
            if !plain_gpu_id(&g.id) || !ids.insert(g.id.as_str()) {
                return Err(invalid(format!(
                    "gpus[{i}].id {:?} is empty, repeated, or more than letters, digits and -_.:",
                    g.id
                )));
            }
            vkd_provider::quantity::bytes(&g.memory)
                .map_err(|e| invalid(format!("gpus[{i}].memory: {e}")))?;
        }
        if cfg.max_pods == 0 {
            return Err(ConfigError::Invalid {
                path: path.to_owned(),
                message: "maxPods must be at least 1".into(),
            });
        }
        Ok(cfg)
    }

    /// The configured GPUs, all free.
    pub fn host_gpus(&self) -> Vec<vkd_provider::Gpu> {
        self.gpus
            .iter()
            .map(|g| vkd_provider::Gpu {
                id: g.id.clone(),
                model: g.model.clone(),
                memory_mib: vkd_provider::quantity::bytes(&g.memory).unwrap_or(0) >> 20,
                nvlink_domain: g.nvlink_domain.clone(),
                numa_node: g.numa_node,
                pcie_root: g.pcie_root.clone(),
                free: true,
                ..Default::default()
            })
            .collect()
    }

    pub fn image(&self, image: &str) -> Option<&ImageMap> {
        self.images.iter().find(|m| m.matches(image))
    }

    /// The uid and gid Pods run as, when vkd is root; `None` when vkd is not root
    /// and so cannot run them as anyone but itself (the provider refuses that).
    pub fn run_as(&self) -> Option<(u32, u32)> {
        if !rustix::process::geteuid().is_root() {
            return None;
        }
        let uid = self.run_as_user.unwrap_or(65534);
        Some((uid, self.run_as_group.unwrap_or(uid)))
    }

    /// The per-Pod process limit, if any.
    pub fn pids_limit(&self) -> Option<u64> {
        Some(self.pod_pids_limit.unwrap_or(DEFAULT_POD_PIDS)).filter(|n| *n > 0)
    }

    /// The per-Pod process limit as an rlimit where the cgroup cannot hold it:
    /// only when the config sets `podPidsLimit` itself.
    pub fn pids_rlimit(&self) -> Option<u64> {
        self.pod_pids_limit.filter(|n| *n > 0)
    }

    /// Where Pod cgroups go: `none`, detected (`auto`), or the configured directory,
    /// which must be a cgroup v2 directory with the memory, cpu and pids controllers.
    pub fn cgroup_parent(
        &self,
    ) -> Result<Option<crate::cgroup::CgroupParent>, crate::cgroup::CgroupError> {
        match self.cgroup_parent.as_str() {
            "none" => Ok(None),
            "auto" => Ok(crate::cgroup::detect()),
            path => crate::cgroup::validate(Path::new(path)).map(Some),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_patterns() {
        let m = ImageMap {
            pattern: "python:3*".into(),
            path: None,
            entrypoint: vec![],
            args: vec![],
            files: Default::default(),
        };
        assert!(m.matches("python:3.12"));
        assert!(!m.matches("python:2"));
        let exact = ImageMap {
            pattern: "busybox".into(),
            ..m
        };
        assert!(exact.matches("busybox"));
        assert!(!exact.matches("busybox:1.36"));
    }

    /// Docker's rules, which agnhost-style images (ENTRYPOINT /agnhost, CMD
    /// pause) rely on.
    #[test]
    fn entrypoint_and_default_args_combine_like_a_runtime() {
        let v = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        let m: ImageMap =
            serde_yaml_ng::from_str("{match: agnhost*, entrypoint: [agnhost], args: [pause]}")
                .unwrap();
        assert_eq!(m.argv(&[], &[]), v(&["agnhost", "pause"]));
        assert_eq!(
            m.argv(&[], &v(&["netexec", "--http-port=8080"])),
            v(&["agnhost", "netexec", "--http-port=8080"])
        );
        assert_eq!(m.argv(&v(&["sh", "-c"]), &[]), v(&["sh", "-c"]));
        assert_eq!(
            m.argv(&v(&["sh"]), &v(&["-c", "true"])),
            v(&["sh", "-c", "true"])
        );
        let bare: ImageMap = serde_yaml_ng::from_str("{match: busybox}").unwrap();
        assert!(bare.argv(&[], &[]).is_empty());
        assert_eq!(bare.argv(&[], &v(&["ls"])), v(&["ls"]));
    }

    #[test]
    fn unknown_keys_are_refused_with_the_file_named() {
        let dir = std::env::temp_dir().join(format!("vkd-pcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.yaml");
        std::fs::write(&p, "imagez: []\n").unwrap();
        let e = ProcessConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains("bad.yaml") && e.contains("imagez"), "{e}");
        std::fs::write(&p, "images: [{match: busybox}]\nmaxPods: 5\n").unwrap();
        let c = ProcessConfig::load(&p).unwrap();
        assert_eq!(c.max_pods, 5);
        assert!(c.image("busybox").is_some());
        assert_eq!((c.pids_limit(), c.pids_rlimit()), (Some(1024), None));
    }

    #[test]
    fn root_and_plain_directories_are_refused_naming_the_field() {
        let dir = std::env::temp_dir().join(format!("vkd-pcfg2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.yaml");
        std::fs::write(&p, "runAsUser: 0\n").unwrap();
        let e = ProcessConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains("runAsUser or runAsGroup 0"), "{e}");
        let plain = dir.join("not-a-cgroup");
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(plain.join("cgroup.procs"), "").unwrap();
        std::fs::write(&p, format!("cgroupParent: {}\n", plain.display())).unwrap();
        let e = ProcessConfig::load(&p).unwrap_err().to_string();
        assert!(
            e.contains("cgroupParent") && e.contains("not a cgroup v2"),
            "{e}"
        );
        std::fs::write(&p, "podPidsLimit: 0\n").unwrap();
        assert_eq!(ProcessConfig::load(&p).unwrap().pids_limit(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Runs `f` on a thread of its own: a read that hangs (a FIFO with no
    /// writer) fails the test instead of stalling it.
    fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the read hung")
    }

    /// A FIFO, a device and an oversized file are refused at once, naming the
    /// file and what it is; a link to a config is followed.
    #[test]
    fn the_config_must_be_a_regular_file_of_bounded_size() {
        let dir = std::env::temp_dir().join(format!("vkd-pcfg4-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.yaml");
        let _ = std::fs::remove_file(&fifo);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = within(move || ProcessConfig::load(&fifo).unwrap_err().to_string());
        assert!(e.contains("fifo.yaml") && e.contains("FIFO"), "{e}");
        let e = within(|| {
            ProcessConfig::load(Path::new("/dev/zero"))
                .unwrap_err()
                .to_string()
        });
        assert!(
            e.contains("/dev/zero") && e.contains("character device"),
            "{e}"
        );
        let big = dir.join("big.yaml");
        let mut text = "maxPods: 5\n".to_owned();
        text.push_str(&"#".repeat(MAX_FILE_BYTES as usize));
        std::fs::write(&big, text).unwrap();
        let e = ProcessConfig::load(&big).unwrap_err().to_string();
        assert!(e.contains("big.yaml") && e.contains("larger than"), "{e}");
        let good = dir.join("good.yaml");
        std::fs::write(&good, "maxPods: 5\n").unwrap();
        let link = dir.join("link.yaml");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&good, &link).unwrap();
        assert_eq!(ProcessConfig::load(&link).unwrap().max_pods, 5);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_plugin_timeout_is_bounded() {
        let dir = std::env::temp_dir().join(format!("vkd-pcfg5-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.yaml");
        let with = |t: &str| {
            let text = format!("network: {{cniConfig: /x.conflist, cniBinDir: /opt/cni/bin{t}}}\n");
            std::fs::write(&p, text).unwrap();
            ProcessConfig::load(&p)
        };
        let n = with("").unwrap().network.unwrap();
        assert_eq!(n.plugin_timeout(), std::time::Duration::from_secs(60));
        let n = with(", pluginTimeoutSeconds: 5").unwrap().network.unwrap();
        assert_eq!(n.plugin_timeout(), std::time::Duration::from_secs(5));
        for bad in ["0", "3601"] {
            let e = with(&format!(", pluginTimeoutSeconds: {bad}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("network.pluginTimeoutSeconds"), "{bad}: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `hostPorts.allowed`: ports and inclusive ranges in 1-65535, none by
    /// default; anything else is refused naming the field.
    #[test]
    fn hostports_allowed_are_ports_and_ranges_none_by_default() {
        let dir = std::env::temp_dir().join(format!("vkd-pcfg6-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.yaml");
        let with = |text: &str| {
            std::fs::write(&p, text).unwrap();
            ProcessConfig::load(&p)
        };
        let none = with("maxPods: 5\n").unwrap().host_ports;
        assert!(none.allowed.is_empty() && !none.allows(8080));
        assert_eq!(
            none.reservations,
            Path::new(crate::hostport::DEFAULT_RESERVATIONS)
        );
        let c = with("hostPorts: {allowed: [\"30000-32767\", 8080, \"9090\"]}\n")
            .unwrap()
            .host_ports;
        let shown: Vec<String> = c.allowed.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["30000-32767", "8080", "9090"]);
        assert!(c.allows(30000) && c.allows(32767) && c.allows(8080) && c.allows(9090));
        assert!(!c.allows(29999) && !c.allows(80));
        for bad in ["0", "70000", "\"9-3\"", "\"http\"", "\"1-65536\"", "-1"] {
            let e = with(&format!("hostPorts: {{allowed: [{bad}]}}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("hostPorts.allowed"), "{bad}: {e}");
        }
        // Where the reservations are is vkd's to say, for every vkd alike.
        assert!(with("hostPorts: {reservations: /tmp/x}\n").is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An image's files: both sides absolute, plain, and the host's present,
    /// or the config is refused with the entry named.
    #[test]
    fn image_files_must_be_plain_absolute_paths_that_exist() {
        let dir = std::env::temp_dir().join(format!("vkd-pcfg3-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("agnhost");
        std::fs::write(&source, "").unwrap();
        let p = dir.join("c.yaml");
        let with = |at: &str, from: &str| {
            let text = format!("images:\n  - match: x\n    files:\n      {at}: {from}\n");
            std::fs::write(&p, text).unwrap();
            ProcessConfig::load(&p)
        };
        let ok = with("/agnhost", &source.display().to_string()).unwrap();
        assert_eq!(ok.images[0].files[Path::new("/agnhost")], source);
        for (at, from) in [
            ("agnhost", source.display().to_string()),
            ("/", source.display().to_string()),
            ("/a/../etc/shadow", source.display().to_string()),
            ("/agnhost", "relative/agnhost".to_owned()),
        ] {
            let e = with(at, &from).unwrap_err().to_string();
            assert!(
                e.contains("images[0].files") && e.contains("absolute"),
                "{at}: {e}"
            );
        }
        let e = with("/agnhost", "/no/such/agnhost")
            .unwrap_err()
            .to_string();
        assert!(e.contains("images[0].files: /no/such/agnhost"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
