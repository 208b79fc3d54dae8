//! End-to-end harness for vkd.
//!
//! Each test binary is one suite: it starts one real control plane (through
//! `e2e/cluster up`) the first time a test needs it, shares it among its tests, and
//! stops it when the suite ends. Tests talk to it only through the real `kubectl`
//! and the files `e2e/cluster` writes. A failing test prints the Nodes, Pods,
//! Events and the tail of every log in the cluster directory, which is then kept
//! for diagnosis; a passing suite removes it.

pub mod aggregated;
pub mod conformance;
pub mod metrics_server;
pub mod monitoring;
pub mod slurm;

use std::collections::BTreeMap;
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;

/// The repository root (this crate lives in `e2e/harness`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")))
}

/// A free loopback TCP port (for a daemon's kubelet or admin server).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `bin` with `args`, stdin closed, stdout and stderr appended to `log`
/// (where failure diagnostics look), with `RUST_LOG` set to `rust_log`.
pub fn spawn_logged(
    bin: &Path,
    args: &[String],
    log: &Path,
    rust_log: &str,
) -> Result<std::process::Child> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    Command::new(bin)
        .args(args)
        .env("RUST_LOG", rust_log)
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))
}

/// The bin directory `e2e/cluster <command>` (`build-metrics-server`,
/// `build-monitoring`, ...) built or found in its cache, and printed.
pub fn built(command: &str) -> Result<PathBuf> {
    let out = Command::new(repo_root().join("e2e/cluster"))
        .arg(command)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running e2e/cluster {command}"))?;
    if !out.status.success() {
        bail!("e2e/cluster {command} failed ({})", out.status);
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// A daemon a suite runs beside its cluster (metrics-server, Prometheus, ...),
/// its output in the cluster's logs; killed and reaped on drop.
#[derive(Debug)]
pub struct Daemon {
    name: String,
    child: std::process::Child,
    log: PathBuf,
}

impl Daemon {
    /// Starts `bin` with `args`, logging to the cluster's `logs/<name>.log`.
    pub fn start(c: &Cluster, name: &str, bin: &Path, args: &[String]) -> Result<Self> {
        let log = c.log_path(name);
        let child = spawn_logged(bin, args, &log, "")?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log,
        })
    }

    /// An error naming the log once the daemon has exited: a wait for it to
    /// serve then ends at once, saying why.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); see {}",
                self.name,
                self.log.display()
            );
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A control plane started by `e2e/cluster up`, stopped by `e2e/cluster down` on drop.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    env: BTreeMap<String, String>,
    keep: AtomicBool,
}

impl Cluster {
    /// Starts a cluster in `e2e/.clusters/<name>-<pid>`, passing `extra` to `up`.
    pub fn up(name: &str, extra: &[&str]) -> Result<Self> {
        let root = repo_root();
        let dir = root
            .join("e2e/.clusters")
            .join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let started = Instant::now();
        let status = Command::new(root.join("e2e/cluster"))
            .arg("up")
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .stdin(Stdio::null())
            .status()
            .context("running e2e/cluster up")?;
        if !status.success() {
            bail!(
                "e2e/cluster up failed ({status}); logs are in {}",
                dir.join("logs").display()
            );
        }
        let env = parse_env(
            &std::fs::read_to_string(dir.join("env")).context("reading the cluster's env file")?,
        );
        eprintln!(
            "e2e: cluster {name} up in {:.1}s at {}",
            started.elapsed().as_secs_f64(),
            dir.display()
        );
        Ok(Self {
            dir,
            env,
            keep: AtomicBool::new(false),
        })
    }

    /// The cluster directory (kubeconfig, pki/, logs/).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A value from DIR/env, for example `VKD_E2E_KUBELET_CLIENT_CA`.
    pub fn env(&self, key: &str) -> Result<&str> {
        self.env
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| anyhow!("{key} missing from {}/env", self.dir.display()))
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// Where a test should write the log of a process it starts, so that failure
    /// diagnostics include it.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{name}.log"))
    }

    /// The API server's address, from the cluster's kubeconfig.
    pub fn apiserver_addr(&self) -> Result<std::net::SocketAddr> {
        let text = std::fs::read_to_string(self.kubeconfig())?;
        let server = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: https://"))
            .context("no https server in the kubeconfig")?;
        Ok(server.trim().parse()?)
    }

    /// The manifests (`manifests/base`) applied to the cluster, and a kubeconfig
    /// that holds only a token of their ServiceAccount, minted through
    /// TokenRequest: what vkd runs with in a real cluster. Made once per cluster.
    pub fn service_account_kubeconfig(&self) -> Result<PathBuf> {
        self.token_kubeconfig("manifests/base", "vkd")
    }

    /// Applies the kustomization `manifests` (relative to the repository) and
    /// returns a kubeconfig with a token of ServiceAccount vkd-system/`account`:
    /// a daemon that uses it has exactly what those manifests grant.
    pub fn token_kubeconfig(&self, manifests: &str, account: &str) -> Result<PathBuf> {
        static ONCE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONCE.lock().unwrap_or_else(|p| p.into_inner());
        let path = self.dir.join(format!("kubeconfig-{account}-sa"));
        if path.exists() {
            return Ok(path);
        }
        let base = repo_root().join(manifests).display().to_string();
        self.kubectl(&["apply", "--server-side", "--force-conflicts", "-k", &base])?;
        self.write_token_kubeconfig(&path, "vkd-system", account)?;
        Ok(path)
    }

    /// Writes to `path` a kubeconfig holding only a token of ServiceAccount
    /// `namespace`/`account`, minted through TokenRequest.
    pub fn write_token_kubeconfig(
        &self,
        path: &Path,
        namespace: &str,
        account: &str,
    ) -> Result<()> {
        let token =
            self.kubectl(&["create", "token", account, "-n", namespace, "--duration=4h"])?;
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: 'https://{}', certificate-authority: '{}'}}}}]\n\
                 users: [{{name: {account}, user: {{token: '{}'}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: {account}}}}}]\ncurrent-context: c\n",
                self.apiserver_addr()?,
                self.env("VKD_E2E_CA")?,
                token.trim()
            ),
        )
        .with_context(|| format!("writing {}", path.display()))
    }

    /// Keeps the cluster directory after the suite (set when a test fails).
    pub fn keep_dir(&self) {
        self.keep.store(true, Ordering::Relaxed);
    }

    fn kubectl_command(&self) -> Result<Command> {
        let mut cmd = Command::new(self.env("VKD_E2E_KUBECTL")?);
        cmd.env("KUBECONFIG", self.kubeconfig());
        Ok(cmd)
    }

    /// Runs the real kubectl against this cluster; returns stdout, or an error with stderr.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_stdin(args, None)
    }

    /// Runs kubectl with `stdin` fed to it.
    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut cmd = self.kubectl_command()?;
        cmd.args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting kubectl")?;
        if let Some(input) = stdin
            && let Some(mut pipe) = child.stdin.take()
        {
            pipe.write_all(input.as_bytes())
                .context("writing kubectl's stdin")?;
        }
        let out = child.wait_with_output().context("waiting for kubectl")?;
        if !out.status.success() {
            bail!(
                "kubectl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs kubectl with `-o json` appended and parses the output.
    pub fn kubectl_json(&self, args: &[&str]) -> Result<Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.kubectl(&all)?;
        serde_json::from_str(&out)
            .with_context(|| format!("kubectl {} gave no JSON", args.join(" ")))
    }

    /// `kubectl apply -f -` with the given YAML.
    pub fn apply(&self, yaml: &str) -> Result<String> {
        self.kubectl_stdin(&["apply", "-f", "-"], Some(yaml))
    }

    /// A fresh namespace for one test, so tests in a suite do not see each other.
    pub fn namespace(&self, name: &str) -> Result<String> {
        self.kubectl(&["create", "namespace", name])?;
        Ok(name.to_owned())
    }

    /// What a person debugging a failure looks at first.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for args in [
            &["get", "nodes", "-o", "wide", "--show-labels"][..],
            &["get", "pods", "-A", "-o", "wide"],
            &["get", "events", "-A", "--sort-by=.lastTimestamp"],
        ] {
            out.push_str(&format!("\n$ kubectl {}\n", args.join(" ")));
            match self.kubectl(args) {
                Ok(text) => out.push_str(&text),
                Err(e) => out.push_str(&format!("{e:#}\n")),
            }
        }
        let mut logs: Vec<_> = std::fs::read_dir(self.dir.join("logs"))
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        logs.sort();
        for log in logs {
            out.push_str(&format!("\n--- tail of {}\n", log.display()));
            out.push_str(&tail(&log, 30));
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let status = Command::new(repo_root().join("e2e/cluster"))
            .arg("down")
            .arg("--dir")
            .arg(&self.dir)
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("e2e: e2e/cluster down failed for {}", self.dir.display());
            return;
        }
        if self.keep.load(Ordering::Relaxed) {
            eprintln!("e2e: kept {} for diagnosis", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn parse_env(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_else(|e| format!("(unreadable: {e})\n"));
    let all: Vec<&str> = text.lines().collect();
    let mut out = all[all.len().saturating_sub(lines)..].join("\n");
    out.push('\n');
    out
}

/// Polls `check` every 500 ms until it returns `Some`, or fails after `timeout`
/// with the last error or the last state `check` described.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => "condition not met".to_owned(),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}: {last}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A test in a suite: gets the shared cluster.
pub type TestFn = fn(&Cluster) -> Result<()>;

/// One suite: a cluster started on first use and shared by its tests.
#[derive(Debug)]
pub struct Suite {
    name: &'static str,
    up_args: Vec<&'static str>,
    cluster: OnceLock<std::result::Result<Cluster, String>>,
    serial: bool,
}

impl Suite {
    pub fn new(name: &'static str, up_args: &[&'static str]) -> Arc<Self> {
        Arc::new(Self {
            name,
            up_args: up_args.to_vec(),
            cluster: OnceLock::new(),
            serial: false,
        })
    }

    /// Tests that disturb the whole cluster (freezing the API server, say) run one at a time.
    pub fn serial(name: &'static str, up_args: &[&'static str]) -> Arc<Self> {
        Arc::new(Self {
            name,
            up_args: up_args.to_vec(),
            cluster: OnceLock::new(),
            serial: true,
        })
    }

    fn cluster(&self) -> std::result::Result<&Cluster, String> {
        self.cluster
            .get_or_init(|| Cluster::up(self.name, &self.up_args).map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| format!("the suite's cluster did not start: {e}"))
    }

    /// Runs the tests (honouring cargo test's filters and flags), then stops the cluster.
    pub fn run(self: Arc<Self>, tests: &[(&'static str, TestFn)]) -> ExitCode {
        let mut args = Arguments::from_args();
        if self.serial {
            args.test_threads = Some(1);
        }
        let trials = tests
            .iter()
            .map(|&(name, test)| {
                let suite = Arc::clone(&self);
                Trial::test(name, move || suite.run_one(name, test))
            })
            .collect();
        let conclusion = libtest_mimic::run(&args, trials);
        // Stop the cluster before exiting: process::exit skips destructors.
        match Arc::try_unwrap(self) {
            Ok(suite) => drop(suite),
            Err(_) => eprintln!("e2e: a test still holds the suite; cluster left running"),
        }
        if conclusion.has_failed() {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        }
    }

    fn run_one(&self, name: &str, test: TestFn) -> std::result::Result<(), Failed> {
        let cluster = self.cluster()?;
        let outcome = catch_unwind(AssertUnwindSafe(|| test(cluster)));
        let error = match outcome {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => format!("{e:#}"),
            Err(panic) => panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "panicked".into()),
        };
        cluster.keep_dir();
        Err(format!(
            "{name}: {error}\n===== diagnostics ====={}",
            cluster.diagnostics()
        )
        .into())
    }
}

/// Reads a JSON path like `status.conditions` from a value, `Null` when absent.
pub fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.')
        .filter(|p| !p.is_empty())
        .fold(v, |v, key| match key.parse::<usize>() {
            Ok(i) => v.get(i).unwrap_or(&Value::Null),
            Err(_) => v.get(key).unwrap_or(&Value::Null),
        })
}

/// The condition of `type` in an object's `status.conditions`.
pub fn condition<'a>(obj: &'a Value, kind: &str) -> Option<&'a Value> {
    at(obj, "status.conditions")
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

/// `t` as a Kubernetes MicroTime (RFC 3339, UTC, exactly six fractional digits).
pub fn micro_time(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn env_file_is_parsed() {
        let env = parse_env("KUBECONFIG=/a/kubeconfig\nVKD_E2E_CA=/a/pki/ca.crt\n\nnoise\n");
        assert_eq!(env["KUBECONFIG"], "/a/kubeconfig");
        assert_eq!(env["VKD_E2E_CA"], "/a/pki/ca.crt");
        assert_eq!(env.len(), 2);
    }

    #[test]
    fn json_paths_and_conditions() {
        let node = json!({"status": {"conditions": [
            {"type": "MemoryPressure", "status": "False"},
            {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}
        ]}});
        assert_eq!(at(&node, "status.conditions.1.reason"), "NodeStatusUnknown");
        assert!(at(&node, "spec.taints").is_null());
        assert_eq!(condition(&node, "Ready").unwrap()["status"], "Unknown");
        assert!(condition(&node, "DiskPressure").is_none());
    }

    #[test]
    fn micro_time_formats_utc() {
        let t = std::time::UNIX_EPOCH + Duration::from_micros(1_796_209_445_123_456);
        assert_eq!(micro_time(t), "2026-12-02T11:04:05.123456Z");
        assert_eq!(
            micro_time(std::time::UNIX_EPOCH),
            "1970-01-01T00:00:00.000000Z"
        );
        let leap = std::time::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(micro_time(leap), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn wait_for_reports_the_last_error() {
        let mut n = 0;
        let err = wait_for("nothing", Duration::from_millis(10), || {
            n += 1;
            Err::<Option<()>, _>(anyhow!("attempt {n}"))
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("waiting for nothing: attempt"),
            "{err}"
        );
        let got = wait_for("three", Duration::from_secs(5), || {
            n += 1;
            Ok((n > 3).then_some(n))
        })
        .unwrap();
        assert!(got > 3);
    }
}
