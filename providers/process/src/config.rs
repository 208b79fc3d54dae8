//! The process provider's config file (`--provider-config`, YAML).
//!
//! ```yaml
//! images:                       # which images may run, and as what
//!   - match: "python:3*"        # exact name, or a prefix ending in *
//!     path: /usr/bin:/bin       # where the command is looked up (default: the usual system PATH)
//!     entrypoint: [python3]     # used when the container gives no command
//! runAsUser: 65534              # default: 65534 when vkd runs as root, vkd's own user otherwise
//! runAsGroup: 65534
//! logMaxBytes: 10485760         # per container log file, before rotation
//! maxPods: 110
//! cgroupParent: auto            # auto | none | a cgroup v2 directory vkd may create children in
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ImageMap {
    #[serde(rename = "match")]
    pub pattern: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub entrypoint: Vec<String>,
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

impl Default for ProcessConfig {
    fn default() -> Self {
        Self {
            images: Vec::new(),
            run_as_user: None,
            run_as_group: None,
            log_max_bytes: default_log_max(),
            max_pods: default_max_pods(),
            cgroup_parent: default_cgroup(),
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
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let cfg: Self = serde_yaml_ng::from_str(&text).map_err(|e| ConfigError::Invalid {
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
        }
        if cfg.max_pods == 0 {
            return Err(ConfigError::Invalid {
                path: path.to_owned(),
                message: "maxPods must be at least 1".into(),
            });
        }
        Ok(cfg)
    }

    pub fn image(&self, image: &str) -> Option<&ImageMap> {
        self.images.iter().find(|m| m.matches(image))
    }

    /// The uid and gid processes run as; `None` keeps vkd's own.
    pub fn run_as(&self) -> Option<(u32, u32)> {
        let root = rustix::process::geteuid().is_root();
        match (self.run_as_user, root) {
            (Some(u), true) => Some((u, self.run_as_group.unwrap_or(u))),
            (None, true) => Some((65534, self.run_as_group.unwrap_or(65534))),
            (_, false) => None,
        }
        .filter(|(u, _)| *u != 0 || self.run_as_group.is_some_and(|g| g != 0))
    }

    /// A cgroup v2 directory vkd may create child groups in, if there is one.
    pub fn cgroup_parent(&self) -> Option<PathBuf> {
        match self.cgroup_parent.as_str() {
            "none" => None,
            "auto" => detect_cgroup(),
            path => Some(PathBuf::from(path)),
        }
    }
}

/// Our own cgroup v2 directory, when the unified hierarchy is mounted, has the
/// memory controller available, and lets us create a child.
fn detect_cgroup() -> Option<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    std::fs::metadata(root.join("cgroup.controllers")).ok()?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = root.join(rel.trim_start_matches('/'));
    let controllers = std::fs::read_to_string(dir.join("cgroup.controllers")).ok()?;
    if !controllers.split_whitespace().any(|c| c == "memory") {
        return None;
    }
    let _ = std::fs::write(dir.join("cgroup.subtree_control"), "+memory +cpu");
    // Usable only if a child we create really gets the memory controller.
    let probe = dir.join(format!("vkd-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).ok()?;
    let usable = probe.join("memory.max").exists();
    let _ = std::fs::remove_dir(&probe);
    usable.then_some(dir)
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
    }
}
