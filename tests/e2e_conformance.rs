//! Node conformance: Kubernetes' own e2e specs (the real `e2e.test` of the
//! control plane's release, run by the real ginkgo) against a cluster whose only
//! node is a vkd process node with no taints.
//!
//! The specs come from the committed lists in `e2e/conformance/` (see
//! docs/conformance.md): each spec of `run.txt` is a test here and must pass; each of
//! `skip.txt` is shown as ignored, with its reason; `lists_cover_the_selection`
//! fails when the binary holds a selected spec neither list names. The table of
//! spec, result and seconds is written to stderr whatever cargo test captures.
//!
//! `VKD_CONFORMANCE_PROCS` sets ginkgo's parallel processes (default 16), and
//! `VKD_CONFORMANCE_TIMEOUT` its suite timeout (default 40m).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use libtest_mimic::{Arguments, Failed, Trial};
use vkd_e2e::conformance::{self, Lists, SpecResult};
use vkd_e2e::{Cluster, condition, repo_root, wait_for};

mod common;
use common::Vkd;

const NODE: &str = "vkd-conformance";
/// What e2e.test calls itself in its reports (and so what a focus must start with).
const SUITE: &str = "Kubernetes e2e suite";

/// Writes to the real stderr: libtest captures only the print macros.
fn say(text: &str) {
    let _ = std::io::stderr().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let dir = repo_root().join("e2e/conformance");
    let lists = match Lists::load(&dir) {
        Ok(l) => l,
        Err(e) => {
            say(&format!("e2e_conformance: {e:#}\n"));
            return ExitCode::FAILURE;
        }
    };
    const COVER: &str = "lists_cover_the_selection";
    let wanted: Vec<&str> = lists
        .run
        .iter()
        .map(String::as_str)
        .filter(|s| selected_by(&args, s))
        .collect();
    let check_lists = selected_by(&args, COVER);
    let outcome = if args.list || (wanted.is_empty() && !check_lists) {
        // Nothing of this suite is selected: build nothing, start nothing.
        None
    } else {
        Some(run_suite(&lists, &wanted, check_lists).map_err(|e| format!("{e:#}")))
    };
    let verdict = |spec: &str| -> std::result::Result<(), Failed> {
        match &outcome {
            Some(Ok(done)) => match done.results.get(spec) {
                Some(r) if r.state == "passed" => Ok(()),
                Some(r) => Err(format!(
                    "{}: {}",
                    r.state,
                    r.message
                        .as_deref()
                        .unwrap_or("(no message; see the ginkgo log)")
                )
                .into()),
                None => Err("did not run (see the ginkgo log)".into()),
            },
            Some(Err(e)) => Err(format!("the suite did not run: {e}").into()),
            None => Ok(()),
        }
    };
    let mut trials = vec![Trial::test(COVER, {
        let problems = match &outcome {
            Some(Ok(done)) => done.problems.clone(),
            Some(Err(e)) => vec![format!("the suite did not run: {e}")],
            None => Vec::new(),
        };
        move || {
            if problems.is_empty() {
                Ok(())
            } else {
                Err(problems.join("\n").into())
            }
        }
    })];
    for spec in &lists.run {
        let result = verdict(spec);
        trials.push(Trial::test(spec.clone(), move || result));
    }
    // Shown as ignored; asked for with --ignored they fail, since they never run.
    let not_run = |label: &str, list: &[(String, String)]| {
        let label = label.to_owned();
        list.iter()
            .map(|(spec, why)| {
                let message = format!("not run ({label}): {why}");
                Trial::test(format!("{spec} ({label}: {why})"), move || {
                    Err(message.into())
                })
                .with_ignored_flag(true)
            })
            .collect::<Vec<_>>()
    };
    trials.extend(not_run("a known defect", &lists.defects));
    trials.extend(not_run("skipped", &lists.skip));
    let conclusion = libtest_mimic::run(&args, trials);
    if conclusion.has_failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Whether cargo test's filter arguments select the test named `name`.
fn selected_by(args: &Arguments, name: &str) -> bool {
    let matches = |pattern: &str| {
        if args.exact {
            name == pattern
        } else {
            name.contains(pattern)
        }
    };
    args.filter.as_deref().is_none_or(matches) && !args.skip.iter().any(|s| matches(s))
}

struct Done {
    results: BTreeMap<String, SpecResult>,
    problems: Vec<String>,
}

fn run_suite(lists: &Lists, wanted: &[&str], check_lists: bool) -> Result<Done> {
    let started = Instant::now();
    let tools = build_tools()?;
    say(&format!(
        "e2e_conformance: e2e.test, ginkgo and agnhost ready in {:.0}s ({})\n",
        started.elapsed().as_secs_f64(),
        tools.display()
    ));
    let mut problems = Vec::new();
    if check_lists {
        let all = dry_run(&tools, lists)?;
        problems = lists.problems(&conformance::select(&lists.selection, &all));
    }
    if wanted.is_empty() {
        return Ok(Done {
            results: BTreeMap::new(),
            problems,
        });
    }
    let cluster = Cluster::up("conformance", &[])?;
    let outcome = run_specs(&cluster, &tools, wanted);
    if outcome.as_ref().is_ok_and(|r| {
        wanted
            .iter()
            .any(|s| r.get(*s).is_none_or(|r| r.state != "passed"))
    }) || outcome.is_err()
    {
        cluster.keep_dir();
    }
    let results = outcome?;
    let listed: Vec<String> = wanted.iter().map(|s| (*s).to_owned()).collect();
    let all: Vec<SpecResult> = results.values().cloned().collect();
    say(&format!(
        "\n{}",
        conformance::table(&conformance::verdicts(&listed, &all), lists)
    ));
    say(&format!(
        "e2e_conformance: {:.0}s in all\n",
        started.elapsed().as_secs_f64()
    ));
    Ok(Done { results, problems })
}

fn build_tools() -> Result<PathBuf> {
    vkd_e2e::built("build-conformance")
}

/// Every spec of the selected families, from e2e.test itself (no cluster needed).
fn dry_run(tools: &Path, lists: &Lists) -> Result<Vec<SpecResult>> {
    let scratch = std::env::temp_dir().join(format!("vkd-conformance-dry-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let report = scratch.join("dry-run.json");
    let out = Command::new(tools.join("e2e.test"))
        .arg("--ginkgo.dry-run")
        .arg("--ginkgo.no-color")
        .arg(format!("--ginkgo.json-report={}", report.display()))
        .arg(format!(
            "--ginkgo.focus={}",
            conformance::family_focus(SUITE, &lists.selection.families)
        ))
        .arg("--provider=skeleton")
        .current_dir(&scratch)
        .stdin(Stdio::null())
        .output()
        .context("running e2e.test --ginkgo.dry-run");
    let report = report_then_clean(out, &report, &scratch);
    let (out, report) = report?;
    ensure!(
        out.status.success(),
        "e2e.test --ginkgo.dry-run failed ({}): {}",
        out.status,
        last_lines(&out.stderr)
    );
    ensure!(
        !report.is_empty(),
        "e2e.test --ginkgo.dry-run wrote no report; its output ends: {}",
        last_lines(&out.stdout)
    );
    let (description, specs) = conformance::read_report(
        &serde_json::from_slice(&report).context("the dry run's report is not JSON")?,
    )?;
    ensure!(
        description == SUITE,
        "e2e.test calls itself {description:?}, not {SUITE:?}: the focus would match nothing"
    );
    Ok(specs)
}

/// The last lines of a command's output, for an error message.
fn last_lines(output: &[u8]) -> String {
    let text = String::from_utf8_lossy(output);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

/// The dry run's output and report, with its scratch directory removed either way.
fn report_then_clean(
    out: Result<std::process::Output>,
    report: &Path,
    scratch: &Path,
) -> Result<(std::process::Output, Vec<u8>)> {
    let read = out.map(|o| (o, std::fs::read(report).unwrap_or_default()));
    let _ = std::fs::remove_dir_all(scratch);
    read
}

/// The process provider's config: which images run here. agnhost is copied where
/// the unprivileged run-as user can execute it (the cache may be in a private home).
/// `@AGNHOST@` and `@BUSYBOX@` in the template are replaced with their paths.
fn provider_config(cluster: &Cluster, tools: &Path, bin: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(bin)?;
    let agnhost = bin.join("agnhost");
    std::fs::copy(tools.join("agnhost"), &agnhost).context("copying agnhost")?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(bin, std::fs::Permissions::from_mode(0o755))?;
    std::fs::set_permissions(&agnhost, std::fs::Permissions::from_mode(0o755))?;
    let template = std::fs::read_to_string(repo_root().join("e2e/conformance/process.yaml"))
        .context("reading e2e/conformance/process.yaml")?;
    // busybox's sh keeps variables whose names are not shell identifiers (envFrom
    // keys like `data-1`); the host's sh may be dash, which drops them, and bash
    // keeps them: it stands in for busybox's sh.
    let shell = bin.join("busybox");
    std::fs::create_dir_all(&shell)?;
    std::os::unix::fs::symlink("/bin/bash", shell.join("sh")).context("linking sh to bash")?;
    std::fs::set_permissions(&shell, std::fs::Permissions::from_mode(0o755))?;
    // The certificate agnhost's image holds for its HTTPS servers.
    let localhost = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    std::fs::write(bin.join("localhost.crt"), localhost.cert.pem())?;
    std::fs::write(
        bin.join("localhost.key"),
        localhost.signing_key.serialize_pem(),
    )?;
    for f in ["localhost.crt", "localhost.key"] {
        std::fs::set_permissions(bin.join(f), std::fs::Permissions::from_mode(0o644))?;
    }
    let path = cluster.dir().join("process.yaml");
    std::fs::write(
        &path,
        template
            .replace("@AGNHOST@", &agnhost.display().to_string())
            .replace("@BIN@", &bin.display().to_string())
            .replace("@BUSYBOX@", &shell.display().to_string()),
    )?;
    Ok(path)
}

/// Gives the node's Pods networks of their own (docs/process-provider.md):
/// the standard CNI plugins, a bridge of this run's and a /16 for Pod IPs,
/// added to the provider config at `config`.
fn with_pod_network(cluster: &Cluster, config: &Path, bridge: &str) -> Result<()> {
    let network = common::cni_network(cluster.dir(), "vkd-conformance", bridge, "10.178.0.0/16")?;
    let mut text = std::fs::read_to_string(config)?;
    text.push_str(&network);
    std::fs::write(config, text)?;
    Ok(())
}

fn run_specs(
    cluster: &Cluster,
    tools: &Path,
    wanted: &[&str],
) -> Result<BTreeMap<String, SpecResult>> {
    let bin = std::env::temp_dir().join(format!("vkd-conformance-{}", std::process::id()));
    let bridge = format!("vkc{:x}", std::process::id() & 0xfffff);
    let outcome = provider_config(cluster, tools, &bin)
        .and_then(|config| with_pod_network(cluster, &config, &bridge).map(|()| config))
        .and_then(|config| run_on_node(cluster, tools, wanted, &config));
    let _ = std::fs::remove_dir_all(&bin);
    let _ = Command::new("ip").args(["link", "del", &bridge]).output();
    outcome
}

fn run_on_node(
    cluster: &Cluster,
    tools: &Path,
    wanted: &[&str],
    config: &Path,
) -> Result<BTreeMap<String, SpecResult>> {
    // vkd runs with the manifests' ServiceAccount, as in the other suites; the
    // manifests' own vkd Deployment would land on this untainted node, where its
    // image cannot run, so it is scaled to nothing first.
    cluster.service_account_kubeconfig()?;
    cluster.kubectl(&[
        "-n",
        "vkd-system",
        "scale",
        "deployment/vkd",
        "--replicas=0",
    ])?;
    let ca = cluster.env("VKD_E2E_KUBELET_CLIENT_CA")?;
    // "Downward API should provide host IP and pod IP as an env var if pod
    // uses host network" runs a hostNetwork Pod, which the node policy
    // refuses by default; no other selected spec uses host namespaces,
    // privileged containers or added capabilities.
    let vkd = Vkd::start_provider(
        cluster,
        NODE,
        "process",
        config,
        &[
            "--node-taint",
            "none",
            "--client-ca-file",
            ca,
            "--allow-privileged",
            "true",
        ],
    )?;
    wait_for("the vkd node to be Ready", Duration::from_secs(60), || {
        let node = cluster.kubectl_json(&["get", "node", NODE])?;
        Ok(condition(&node, "Ready")
            .is_some_and(|c| c["status"] == "True")
            .then_some(()))
    })?;
    let procs = std::env::var("VKD_CONFORMANCE_PROCS").unwrap_or_else(|_| "16".into());
    let timeout = std::env::var("VKD_CONFORMANCE_TIMEOUT").unwrap_or_else(|_| "40m".into());
    let out_dir = cluster.dir().join("conformance");
    std::fs::create_dir_all(&out_dir)?;
    let log = cluster.log_path("ginkgo");
    let log_file = std::fs::File::create(&log)?;
    say(&format!(
        "e2e_conformance: running {} specs on {procs} processes; ginkgo's log: {}\n",
        wanted.len(),
        log.display()
    ));
    let started = Instant::now();
    let status = Command::new(tools.join("ginkgo"))
        .arg("run")
        .arg(format!("--procs={procs}"))
        .arg("--no-color")
        .arg("--silence-skips")
        .arg(format!("--timeout={timeout}"))
        .arg(format!("--output-dir={}", out_dir.display()))
        .arg("--json-report=report.json")
        .arg(format!(
            "--focus={}",
            conformance::exact_focus(SUITE, wanted)
        ))
        .arg(tools.join("e2e.test"))
        .arg("--")
        .arg(format!("--kubeconfig={}", cluster.kubeconfig().display()))
        .arg("--provider=skeleton")
        .arg(format!(
            "--kubectl-path={}",
            cluster.env("VKD_E2E_KUBECTL")?
        ))
        .arg(format!("--report-dir={}", out_dir.display()))
        .arg("--node-schedulable-timeout=2m")
        .arg("--system-pods-startup-timeout=1m")
        .current_dir(&out_dir)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .status()
        .context("running ginkgo")?;
    say(&format!(
        "e2e_conformance: ginkgo ended ({status}) after {:.0}s\n",
        started.elapsed().as_secs_f64()
    ));
    drop(vkd);
    let report = out_dir.join("report.json");
    if !report.exists() {
        bail!("ginkgo wrote no report ({status}); see {}", log.display());
    }
    let (_, specs) = conformance::read_report(&serde_json::from_slice(&std::fs::read(&report)?)?)?;
    let ran: BTreeSet<&str> = wanted.iter().copied().collect();
    Ok(specs
        .into_iter()
        .filter(|s| ran.contains(s.spec.as_str()) || s.state != "skipped")
        .map(|s| (s.spec.clone(), s))
        .collect())
}
