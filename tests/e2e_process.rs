//! End-to-end: the process provider on the real control plane, through the real
//! kubectl. Every container here is a real host process, run as an unprivileged
//! user by a shim that outlives vkd.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, condition, wait_for};

mod common;
use common::{Vkd, items, running_and_ready, str_at};

fn main() -> ExitCode {
    let code = Suite::new("process", &[]).run(&[
        ("exec_runs_a_real_command", exec_real_command),
        ("logs_stream_as_written", logs_stream),
        (
            "readiness_probe_holds_ready_false_until_it_passes",
            readiness,
        ),
        ("failing_liveness_probe_restarts_the_container", liveness),
        ("crash_loop_shows_crash_loop_back_off", crash_loop),
        ("memory_limit_is_enforced", memory_limit),
        (
            "pre_stop_runs_and_sigterm_comes_before_sigkill",
            termination,
        ),
        (
            "config_map_and_secret_content_reaches_the_process_and_follows_updates",
            config_and_secrets,
        ),
        ("bad_input_fails_clearly_and_leaks_nothing", bad_input),
        (
            "a_link_in_place_of_a_volume_is_never_followed_and_api_volumes_are_read_only",
            links_in_volumes,
        ),
        (
            "service_env_config_errors_and_active_deadline_as_the_kubelet",
            kubelet_semantics,
        ),
        (
            "init_containers_sidecars_and_final_status_as_the_kubelet",
            init_and_sidecars,
        ),
        (
            "kubectl_debug_runs_an_ephemeral_container_in_the_pod",
            ephemeral_containers,
        ),
        ("kill_9_keeps_processes_and_restart_adopts_them", adoption),
        (
            "attach_reaches_stdin_over_websocket_and_spdy_across_a_restart",
            attach,
        ),
        (
            "statefulset_rollout_and_rollback_and_a_job_restarted_in_place",
            workload_controllers,
        ),
    ]);
    if let Some(Ok(v)) = VKD.lock().unwrap_or_else(|p| p.into_inner()).take() {
        v.reap_processes();
    }
    code
}

const NS: &str = "proc";
const NODE: &str = "vk-proc";

static VKD: Mutex<Option<std::result::Result<Vkd, String>>> = Mutex::new(None);

/// The suite's vkd: namespaces `proc` and `proc-kill` only, hostPath allowed.
fn vkd(c: &Cluster) -> Result<std::path::PathBuf> {
    let mut slot = VKD.lock().unwrap_or_else(|p| p.into_inner());
    let v = slot.get_or_insert_with(|| {
        let ca = c.env("VKD_E2E_KUBELET_CLIENT_CA").map(str::to_owned);
        let start = || -> Result<Vkd> {
            let ca = ca.map_err(|e| anyhow::anyhow!("{e}"))?;
            let v = Vkd::start_process(
                c,
                NODE,
                &[
                    "--node-label",
                    "vkd.io/e2e=proc",
                    "--client-ca-file",
                    &ca,
                    "--allowed-namespace",
                    NS,
                    "--allow-host-path",
                    "true",
                ],
            )?;
            c.namespace(NS)?;
            c.namespace("proc-denied")?;
            // The node says who may run what on it.
            let policy = wait_for(
                "the node's policy annotation",
                Duration::from_secs(30),
                || {
                    let n = c.kubectl_json(&["get", "node", NODE])?;
                    Ok(at(&n, "metadata.annotations")
                        .get("vkd.io/policy")
                        .and_then(Value::as_str)
                        .map(str::to_owned))
                },
            )?;
            ensure!(
                policy
                    == "namespaces=proc secrets=allowed configmaps=allowed hostpath=allowed \
                        privileged=refused",
                "{policy}"
            );
            Ok(v)
        };
        start().map_err(|e| format!("{e:#}"))
    });
    v.as_ref()
        .map(|v| v.state_dir.clone())
        .map_err(|e| anyhow::anyhow!("vkd did not start: {e}"))
}

fn pod(name: &str, ns: &str, node_label: &str, body: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{vkd.io/e2e: {node_label}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
{body}
"#
    )
}

fn instance_id(p: &Value) -> String {
    at(p, "metadata.annotations")
        .get("vkd.io/instance-id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn get(c: &Cluster, name: &str) -> Result<Value> {
    c.kubectl_json(&["get", "pod", name, "-n", NS])
}

fn container_status(p: &Value) -> Value {
    at(p, "status.containerStatuses")
        .get(0)
        .cloned()
        .unwrap_or(Value::Null)
}

fn wait_running(c: &Cluster, name: &str) -> Result<Value> {
    wait_for(
        &format!("{name} to be Running and Ready"),
        Duration::from_secs(60),
        || {
            let p = get(c, name)?;
            Ok(running_and_ready(&p).then_some(p))
        },
    )
}

fn delete_now(c: &Cluster, name: &str) -> Result<()> {
    c.kubectl(&[
        "delete",
        "pod",
        name,
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    Ok(())
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Result<Vec<(u32, String)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if text.contains(marker) && !text.contains("process-launch") {
            out.push((pid, text));
        }
    }
    Ok(out)
}

fn uid_of(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn exec_real_command(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&pod(
        "exec-target",
        NS,
        "proc",
        r#"  containers:
  - name: main
    image: busybox
    command: [sh, -c, "echo started; sleep 3600; : marker-exec-target"]
    workingDir: /srv
    env: [{name: GREETING, value: hello-from-env}]"#,
    ))?;
    wait_running(c, "exec-target")?;
    let out = c.kubectl(&[
        "exec",
        "exec-target",
        "-n",
        NS,
        "--",
        "sh",
        "-c",
        "echo $GREETING; id -u; pwd; echo pid=$$",
    ])?;
    let lines: Vec<&str> = out.lines().collect();
    ensure!(
        lines.first() == Some(&"hello-from-env"),
        "env not seen: {out:?}"
    );
    // With namespaces, the path itself; without, that path under the Pod's root.
    let wd_ok = if namespaces(c)? {
        lines.get(2) == Some(&"/srv")
    } else {
        lines.get(2).is_some_and(|l| l.ends_with("/root/srv"))
    };
    ensure!(wd_ok, "workingDir not used: {out:?}");
    let pid: u32 = lines
        .get(3)
        .and_then(|l| l.strip_prefix("pid="))
        .and_then(|p| p.parse().ok())
        .context("no pid")?;
    ensure!(pid > 1, "not a real process id: {out:?}");
    // As root, vkd runs Pods as nobody; as anyone else, as itself.
    let me = rustix_uid();
    let want = if me == 0 { 65534 } else { me };
    ensure!(
        lines.get(1) == Some(&want.to_string().as_str()),
        "ran as uid {:?}, wanted {want}",
        lines.get(1)
    );
    let procs = processes_with("marker-exec-target")?;
    ensure!(
        procs.len() == 1,
        "one host process for the container: {procs:?}"
    );
    ensure!(
        uid_of(procs[0].0) == Some(want),
        "the container runs as {:?}",
        uid_of(procs[0].0)
    );
    // With namespaces, ps in the container shows the Pod's processes alone:
    // its sh as PID 1, its sleep, and ps itself.
    if namespaces(c)? {
        let ps = c.kubectl(&[
            "exec",
            "exec-target",
            "-n",
            NS,
            "--",
            "ps",
            "-e",
            "-o",
            "pid=,args=",
        ])?;
        let seen: Vec<(&str, &str)> = ps
            .lines()
            .filter_map(|l| l.trim().split_once(' '))
            .collect();
        ensure!(
            seen.first()
                .is_some_and(|(pid, args)| *pid == "1" && args.contains("marker-exec-target")),
            "PID 1 is not the container's program: {ps}"
        );
        ensure!(
            seen.len() == 3
                && seen.iter().all(|(_, a)| a.contains("marker-exec-target")
                    || a.starts_with("sleep")
                    || a.starts_with("ps")),
            "ps shows more than the Pod's processes: {ps}"
        );
        eprintln!("exec: ps in the container shows {} processes", seen.len());
    }
    // A command that does not exist: kubectl reports the exit code.
    let code = kubectl_status(
        c,
        &["exec", "exec-target", "-n", NS, "--", "no-such-command-vkd"],
    )?;
    ensure!(code != 0, "a missing command succeeded");
    eprintln!(
        "exec: uid {want}, container pid {}, missing command exit {code}",
        procs[0].0
    );
    delete_now(c, "exec-target")?;
    ensure!(
        processes_with("marker-exec-target")?.is_empty(),
        "the process outlived its Pod"
    );
    Ok(())
}

fn rustix_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn kubectl_cmd(c: &Cluster) -> Result<Command> {
    let mut cmd = Command::new(c.env("VKD_E2E_KUBECTL")?);
    cmd.env("KUBECONFIG", c.kubeconfig());
    Ok(cmd)
}

fn kubectl_status(c: &Cluster, args: &[&str]) -> Result<i32> {
    let st = kubectl_cmd(c)?
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    Ok(st.code().unwrap_or(-1))
}

fn logs_stream(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&pod(
        "talker",
        NS,
        "proc",
        r#"  restartPolicy: Never
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "i=0; while [ $i -lt 12 ]; do echo line $i; i=$((i+1)); sleep 0.25; done"]"#,
    ))?;
    wait_for("talker to run", Duration::from_secs(60), || {
        let p = get(c, "talker")?;
        Ok((at(&p, "status.phase") == "Running").then_some(()))
    })?;
    let started = Instant::now();
    let mut child = kubectl_cmd(c)?
        .args(["logs", "-f", "talker", "-n", NS])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let out = child.stdout.take().context("no stdout")?;
    let mut arrivals = Vec::new();
    for line in BufReader::new(out).lines() {
        arrivals.push((started.elapsed(), line?));
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "logs -f did not end with the container"
        );
    }
    ensure!(child.wait()?.success(), "kubectl logs -f failed");
    let texts: Vec<&str> = arrivals.iter().map(|(_, l)| l.as_str()).collect();
    let want: Vec<String> = (0..12).map(|i| format!("line {i}")).collect();
    ensure!(texts == want, "lines: {texts:?}");
    let spread = arrivals[11].0.saturating_sub(arrivals[0].0);
    ensure!(
        spread >= Duration::from_millis(500) || arrivals[0].0 > Duration::ZERO,
        "{arrivals:?}"
    );
    // Timestamps come from the log file the shim wrote.
    let ts = c.kubectl(&["logs", "talker", "-n", NS, "--timestamps", "--tail=1"])?;
    ensure!(
        ts.trim_end().ends_with("line 11") && ts.contains('T') && ts.contains('Z'),
        "{ts:?}"
    );
    eprintln!(
        "logs -f: 12 lines, the last {:.1}s after the first",
        spread.as_secs_f64()
    );
    delete_now(c, "talker")
}

fn readiness(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&pod(
        "web",
        NS,
        "proc",
        r#"  containers:
  - name: main
    image: python:3.12
    command: [sh, -c, "sleep 4; exec python3 -m http.server 18481 --bind 127.0.0.1"]
    ports: [{name: http, containerPort: 18481}]
    readinessProbe:
      httpGet: {path: /, port: http}
      periodSeconds: 1"#,
    ))?;
    let running_unready = wait_for("web Running but not Ready", Duration::from_secs(60), || {
        let p = get(c, "web")?;
        let ready = condition(&p, "Ready").is_some_and(|c| c["status"] == "True");
        Ok((at(&p, "status.phase") == "Running" && !ready).then_some(Instant::now()))
    })?;
    let p = wait_running(c, "web")?;
    let waited = running_unready.elapsed();
    ensure!(
        container_status(&p)["ready"] == true,
        "container not ready: {p}"
    );
    ensure!(
        waited >= Duration::from_secs(1),
        "Ready came {waited:?} after Running-but-unready"
    );
    eprintln!(
        "readiness: Ready {:.1}s after the Pod was seen Running and unready",
        waited.as_secs_f64()
    );
    delete_now(c, "web")
}

fn liveness(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&pod(
        "unwell",
        NS,
        "proc",
        r#"  containers:
  - name: main
    image: busybox
    command: [sh, -c, "touch alive; sleep 2; rm alive; exec sleep 3600"]
    livenessProbe:
      exec: {command: [test, -f, alive]}
      periodSeconds: 1
      failureThreshold: 1"#,
    ))?;
    let started = Instant::now();
    let counts = wait_for("restartCount to reach 2", Duration::from_secs(60), || {
        let p = get(c, "unwell")?;
        let n = container_status(&p)["restartCount"].as_u64().unwrap_or(0);
        Ok((n >= 2).then_some((n, p)))
    })?;
    let last = &container_status(&counts.1)["lastState"]["terminated"];
    ensure!(
        last["exitCode"].as_i64().is_some(),
        "no last termination: {}",
        counts.1
    );
    eprintln!(
        "liveness: restartCount {} after {:.1}s, last exit {}",
        counts.0,
        started.elapsed().as_secs_f64(),
        last["exitCode"]
    );
    // The kubelet's Events for it, about the container, as `kubectl describe`
    // and `kubectl get events` show them.
    let events = wait_for(
        "Unhealthy and Killing Events",
        Duration::from_secs(30),
        || {
            let list = c.kubectl_json(&[
                "get",
                "events",
                "-n",
                NS,
                "--field-selector",
                "involvedObject.name=unwell",
            ])?;
            let items = list["items"].as_array().cloned().unwrap_or_default();
            let has = |reason: &str| items.iter().any(|e| e["reason"] == reason);
            Ok((has("Unhealthy") && has("Killing")).then_some(items))
        },
    )?;
    let unhealthy = events
        .iter()
        .find(|e| e["reason"] == "Unhealthy")
        .context("an Unhealthy Event")?;
    ensure!(
        unhealthy["type"] == "Warning"
            && str_at(unhealthy, "message").starts_with("Liveness probe failed")
            && unhealthy["involvedObject"]["fieldPath"] == "spec.containers{main}",
        "{unhealthy}"
    );
    let killing = events
        .iter()
        .find(|e| e["reason"] == "Killing")
        .context("a Killing Event")?;
    ensure!(
        str_at(killing, "message") == "Container main failed liveness probe, will be restarted",
        "{killing}"
    );
    eprintln!("liveness: Events {:?}", str_at(unhealthy, "message"));
    delete_now(c, "unwell")
}

fn crash_loop(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&pod(
        "crasher",
        NS,
        "proc",
        r#"  containers:
  - name: main
    image: busybox
    command: [sh, -c, "echo about to fail; exit 2"]"#,
    ))?;
    let p = wait_for("CrashLoopBackOff", Duration::from_secs(60), || {
        let p = get(c, "crasher")?;
        let cs = container_status(&p);
        Ok((cs["state"]["waiting"]["reason"] == "CrashLoopBackOff").then_some(p))
    })?;
    let cs = container_status(&p);
    ensure!(cs["lastState"]["terminated"]["exitCode"] == 2, "{cs}");
    ensure!(cs["lastState"]["terminated"]["reason"] == "Error", "{cs}");
    ensure!(cs["restartCount"].as_u64() >= Some(1), "{cs}");
    let msg = str_at(&cs, "state.waiting.message");
    ensure!(msg.contains("back-off 10s"), "{msg:?}");
    let prev = c.kubectl(&["logs", "crasher", "-n", NS, "--previous"])?;
    ensure!(prev.contains("about to fail"), "{prev:?}");
    eprintln!("crash loop: {msg}");
    delete_now(c, "crasher")
}

fn memory_limit(c: &Cluster) -> Result<()> {
    vkd(c)?;
    let cgroup_v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    c.apply(&pod(
        "hungry",
        NS,
        "proc",
        r#"  restartPolicy: Never
  containers:
  - name: main
    image: python:3.12
    command: [python3, -c, "b = bytearray(512 * 1024 * 1024); print('allocated', len(b))"]
    resources: {limits: {memory: 64Mi}}"#,
    ))?;
    let p = wait_for("the hungry Pod to end", Duration::from_secs(60), || {
        let p = get(c, "hungry")?;
        let phase = str_at(&p, "status.phase").to_owned();
        Ok((phase == "Failed" || phase == "Succeeded").then_some(p))
    })?;
    let t = &container_status(&p)["state"]["terminated"];
    ensure!(
        at(&p, "status.phase") == "Failed",
        "512 MiB fit under a 64 MiB limit: {t}"
    );
    if cgroup_v2 {
        ensure!(t["reason"] == "OOMKilled", "cgroup v2 here, but: {t}");
        eprintln!("memory limit: OOMKilled (cgroup v2)");
    } else {
        // rlimits refuse the allocation instead of the kernel killing: no OOMKilled to see.
        let logs = c.kubectl(&["logs", "hungry", "-n", NS])?;
        ensure!(logs.contains("MemoryError"), "{logs:?}");
        eprintln!(
            "memory limit: SKIPPED the OOMKilled check (no cgroup v2 on this host); \
             the rlimit refused the allocation: exit {} {}",
            t["exitCode"], t["reason"]
        );
    }
    delete_now(c, "hungry")
}

fn termination(c: &Cluster) -> Result<()> {
    vkd(c)?;
    let dir = std::env::temp_dir().join(format!("vkd-e2e-term-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Command::new("chmod").arg("777").arg(&dir).status()?;
    let record = dir.join("record");
    let body = format!(
        r#"  terminationGracePeriodSeconds: 20
  volumes: [{{name: out, hostPath: {{path: {}}}}}]
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "trap 'echo TERM $(date +%s%N) >> out/record; exit 0' TERM; while true; do sleep 0.1; done"]
    workingDir: /
    volumeMounts: [{{name: out, mountPath: /out}}]
    lifecycle:
      preStop:
        exec: {{command: [sh, -c, "echo PRESTOP $(date +%s%N) >> out/record"]}}"#,
        dir.display()
    );
    c.apply(&pod("graceful", NS, "proc", &body))?;
    wait_running(c, "graceful")?;
    let started = Instant::now();
    delete_now(c, "graceful")?;
    let graceful_took = started.elapsed();
    let text = std::fs::read_to_string(&record).context("no record written")?;
    let lines: Vec<&str> = text.lines().collect();
    ensure!(lines.len() == 2, "{text:?}");
    ensure!(
        lines[0].starts_with("PRESTOP ") && lines[1].starts_with("TERM "),
        "order: {text:?}"
    );
    ensure!(
        graceful_took < Duration::from_secs(15),
        "a process that exits on SIGTERM took {graceful_took:?}"
    );
    // One that ignores SIGTERM is killed when its grace period ends.
    c.apply(&pod(
        "stubborn",
        NS,
        "proc",
        r#"  terminationGracePeriodSeconds: 3
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "trap '' TERM; while true; do sleep 0.1; done # marker-stubborn"]"#,
    ))?;
    wait_running(c, "stubborn")?;
    ensure!(processes_with("marker-stubborn")?.len() == 1, "not running");
    let started = Instant::now();
    delete_now(c, "stubborn")?;
    let took = started.elapsed();
    ensure!(
        processes_with("marker-stubborn")?.is_empty(),
        "SIGKILL did not come"
    );
    ensure!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(15),
        "stubborn took {took:?}"
    );
    eprintln!(
        "termination: preStop then SIGTERM ({text:?}), graceful delete {:.1}s; SIGTERM ignored: killed, delete took {:.1}s at grace 3s",
        graceful_took.as_secs_f64(),
        took.as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn config_and_secrets(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: ConfigMap
metadata: {{name: app-config, namespace: {NS}}}
data: {{greeting: "hello from a configmap", mode: fast}}
---
apiVersion: v1
kind: Secret
metadata: {{name: app-secret, namespace: {NS}}}
stringData: {{password: s3cr3t-value}}
"#
    ))?;
    c.apply(&pod(
        "configured",
        NS,
        "proc",
        r#"  containers:
  - name: main
    image: busybox
    command: [sleep, "3600"]
    resources: {limits: {memory: 128Mi, cpu: 500m}}
    env:
    - {name: PASSWORD, valueFrom: {secretKeyRef: {name: app-secret, key: password}}}
    - {name: GREETING, valueFrom: {configMapKeyRef: {name: app-config, key: greeting}}}
    - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
    - {name: MEM_LIMIT, valueFrom: {resourceFieldRef: {resource: limits.memory, divisor: 1Mi}}}
    envFrom: [{prefix: CFG_, configMapRef: {name: app-config}}]
    volumeMounts:
    - {name: config, mountPath: /etc/app}
    - {name: secret, mountPath: /etc/secret}
    - {name: info, mountPath: /etc/podinfo}
  volumes:
  - {name: config, configMap: {name: app-config}}
  - {name: secret, secret: {secretName: app-secret}}
  - name: info
    downwardAPI:
      items:
      - {path: name, fieldRef: {fieldPath: metadata.name}}
      - {path: labels, fieldRef: {fieldPath: metadata.labels}}"#,
    ))?;
    wait_running(c, "configured")?;
    let out = c.kubectl(&[
        "exec",
        "configured",
        "-n",
        NS,
        "--",
        "sh",
        "-c",
        "cat $VKD_POD_ROOT/etc/app/greeting; echo; cat etc/secret/password; echo; \
         stat -L -c %a etc/secret/password; cat etc/podinfo/name; echo; \
         echo $PASSWORD $POD_NAME $MEM_LIMIT $CFG_mode; \
         ls $VKD_POD_ROOT/var/run/secrets/kubernetes.io/serviceaccount",
    ])?;
    let lines: Vec<&str> = out.lines().collect();
    ensure!(lines.first() == Some(&"hello from a configmap"), "{out:?}");
    ensure!(lines.get(1) == Some(&"s3cr3t-value"), "{out:?}");
    ensure!(lines.get(2) == Some(&"644"), "secret file mode: {out:?}");
    ensure!(lines.get(3) == Some(&"configured"), "{out:?}");
    ensure!(
        lines.get(4) == Some(&"s3cr3t-value configured 128 fast"),
        "{out:?}"
    );
    ensure!(
        out.contains("token") && out.contains("ca.crt") && out.contains("namespace"),
        "service account files: {out:?}"
    );
    eprintln!(
        "config: configMap, secret (0644 in a 0700 directory), downwardAPI, env refs and the ServiceAccount token all present"
    );

    // The volumes follow their sources while the Pod runs, as on the kubelet:
    // a changed ConfigMap and Secret within the sync period (a key removed
    // takes its file with it), new labels at once.
    let read =
        |script: &str| c.kubectl(&["exec", "configured", "-n", NS, "--", "sh", "-c", script]);
    c.kubectl(&[
        "patch", "configmap", "app-config", "-n", NS, "--type=json",
        "-p", r#"[{"op":"replace","path":"/data/greeting","value":"hello again"},{"op":"remove","path":"/data/mode"}]"#,
    ])?;
    c.kubectl(&[
        "patch",
        "secret",
        "app-secret",
        "-n",
        NS,
        "--type=merge",
        "-p",
        r#"{"stringData":{"password":"rotated-value"}}"#,
    ])?;
    let changed = Instant::now();
    wait_for(
        "the configMap and secret volumes to follow",
        Duration::from_secs(100),
        || {
            let out =
                read("cat etc/app/greeting; echo; cat etc/secret/password; echo; ls etc/app")?;
            Ok(
                (out.lines().collect::<Vec<_>>() == ["hello again", "rotated-value", "greeting"])
                    .then_some(()),
            )
        },
    )?;
    let followed_in = changed.elapsed();
    // The Pod's mode (the API's default 0644), in a directory only the Pod's
    // user may enter, so no other host user reads it.
    let mode = read("stat -L -c %a etc/secret/password etc/secret")?;
    ensure!(
        mode.split_whitespace().collect::<Vec<_>>() == ["644", "700"],
        "the rewritten secret file's and its volume's modes: {mode:?}"
    );
    c.kubectl(&["label", "pod", "configured", "-n", NS, "tier=gold"])?;
    let labelled = Instant::now();
    wait_for(
        "the downwardAPI labels to follow",
        Duration::from_secs(30),
        || {
            let out = read("cat etc/podinfo/labels")?;
            Ok(out.contains("tier=\"gold\"").then_some(()))
        },
    )?;
    eprintln!(
        "config: volumes followed a ConfigMap and Secret change in {:.1}s and a label in {:.1}s",
        followed_in.as_secs_f64(),
        labelled.elapsed().as_secs_f64()
    );
    delete_now(c, "configured")
}

/// `kubectl get`'s READY and STATUS columns for a Pod.
/// Issue 51, finding 1: an init container that puts a link where its
/// emptyDir was (in the sandbox on the host) or inside it (for a subPath)
/// never gets the next container a view of the host; and finding 9: the
/// volumes the kubelet writes from the API are read-only in the container.
fn links_in_volumes(c: &Cluster) -> Result<()> {
    let state = std::fs::canonicalize(vkd(c)?)?;
    let pods = state.join("process/pods");
    c.apply(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: link-config, namespace: {NS}}}\ndata: {{key: from-the-api}}\n"
    ))?;
    // The sandbox's path on the host, as the tenant can work it out, and
    // the one `$VKD_POD_ROOT` led to before. vkd made the subPath
    // directories when it made the Pod: the init container replaces them.
    let plant = format!(
        "for v in {pods}/$POD_UID/volumes/data \"$VKD_POD_ROOT/../volumes/data\"; do \
           rm -rf \"$v\" 2>/dev/null; ln -s / \"$v\" 2>/dev/null && echo \"planted $v\"; done; \
         mkdir -p /data/sub/deep && echo deep > /data/sub/deep/marker; \
         rmdir /data/escape /data/up /data/inside; \
         ln -s / /data/escape; ln -s ../../../../../.. /data/up; ln -s sub/deep /data/inside; \
         echo done",
        pods = pods.display()
    );
    let look = "ls -a /data | tr '\\n' ' '; echo; cat /inside/marker; \
                (echo changed > /etc/app/key) 2>/dev/null && echo config-written || echo config-read-only; \
                (mkdir /etc/app/new) 2>/dev/null && echo config-dir-made || echo config-dir-refused; \
                cat /etc/app/key; echo; echo looked; exec sleep 3600";
    c.apply(&pod(
        "linker",
        NS,
        "proc",
        &format!(
            r#"  restartPolicy: Never
  initContainers:
  - name: plant
    image: busybox
    command: [sh, -c, {plant}]
    env: [{{name: POD_UID, valueFrom: {{fieldRef: {{fieldPath: metadata.uid}}}}}}]
    volumeMounts: [{{name: data, mountPath: /data}}]
  containers:
  - name: main
    image: busybox
    command: [sh, -c, {look}]
    volumeMounts:
    - {{name: data, mountPath: /data}}
    - {{name: data, mountPath: /inside, subPath: inside}}
    - {{name: config, mountPath: /etc/app}}
  - name: escape
    image: busybox
    command: [sh, -c, "ls /esc; exec sleep 3600"]
    volumeMounts: [{{name: data, mountPath: /esc, subPath: escape}}]
  - name: up
    image: busybox
    command: [sh, -c, "ls /up; exec sleep 3600"]
    volumeMounts: [{{name: data, mountPath: /up, subPath: up}}]
  volumes:
  - {{name: data, emptyDir: {{}}}}
  - {{name: config, configMap: {{name: link-config}}}}"#,
            plant = serde_json::to_string(&plant)?,
            look = serde_json::to_string(look)?,
        ),
    ))?;
    let log = wait_for("the main container's look", Duration::from_secs(90), || {
        let l = c
            .kubectl(&["logs", "-n", NS, "linker", "-c", "main"])
            .unwrap_or_default();
        Ok(l.contains("looked").then_some(l))
    })?;
    let planted = c.kubectl(&["logs", "-n", NS, "linker", "-c", "plant"])?;
    let listing = log.lines().next().unwrap_or_default();
    for host in ["etc", "proc", "usr"] {
        ensure!(
            !listing.split_whitespace().any(|e| e == host),
            "the Pod's emptyDir shows the host's /: {listing} (the init container said {planted:?})"
        );
    }
    ensure!(
        listing.split_whitespace().any(|e| e == "escape"),
        "the emptyDir lost what the init container wrote: {listing}"
    );
    ensure!(
        !planted.contains("planted"),
        "the sandbox's volume directory is writable from a container: {planted}"
    );
    ensure!(
        log.lines().nth(1) == Some("deep"),
        "a link inside the volume: {log}"
    );
    ensure!(
        log.contains("config-read-only") && log.contains("config-dir-refused"),
        "a configMap volume is writable: {log}"
    );
    ensure!(log.contains("from-the-api"), "{log}");
    // A subPath through a link out of the volume never starts, and says why.
    for name in ["escape", "up"] {
        let why = wait_for(
            &format!("container {name} to fail"),
            Duration::from_secs(60),
            || {
                let p = get(c, "linker")?;
                let st = at(&p, "status.containerStatuses")
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|s| str_at(s, "name") == name)
                    .cloned();
                Ok(st.and_then(|s| {
                    let t = at(&s, "state.terminated");
                    (!t.is_null())
                        .then(|| format!("{} {}", str_at(t, "reason"), str_at(t, "message")))
                }))
            },
        )?;
        let seen = c
            .kubectl(&["logs", "-n", NS, "linker", "-c", name])
            .unwrap_or_default();
        ensure!(
            seen.contains("leads out of its volume"),
            "{name} ({why}) said: {seen}"
        );
        ensure!(!seen.contains("etc"), "{name} listed the host: {seen}");
    }
    delete_now(c, "linker")
}

fn ready_and_status(c: &Cluster, name: &str) -> Result<(String, String)> {
    let line = c.kubectl(&["get", "pod", name, "-n", NS, "--no-headers"])?;
    let cols: Vec<&str> = line.split_whitespace().collect();
    Ok((
        cols.get(1).copied().unwrap_or_default().to_owned(),
        cols.get(2).copied().unwrap_or_default().to_owned(),
    ))
}

fn condition_of<'a>(p: &'a Value, t: &str) -> &'a Value {
    at(p, "status.conditions")
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == t))
        .unwrap_or(&Value::Null)
}

/// Init containers and sidecars as the kubelet reports them, through the real
/// kubectl: Init:0/2 while they run (Initialized False, naming them; the
/// container PodInitializing), the init container's log, a sidecar counted in
/// READY, Init:Error with a FallbackToLogsOnError message, Init:CrashLoopBackOff;
/// and a deleted Pod a finalizer holds keeps the final states of its containers
/// (Succeeded: the container exited 0 on SIGTERM, leaving a termination message;
/// the sidecar's own exit code does not count).
/// Whether the process node gives containers namespaces of their own (its
/// `vkd.io/isolation` annotation).
fn namespaces(c: &Cluster) -> Result<bool> {
    let n = c.kubectl_json(&["get", "node", NODE])?;
    let mode = at(&n, "metadata.annotations")
        .get("vkd.io/isolation")
        .and_then(Value::as_str)
        .context("the node has no vkd.io/isolation annotation")?
        .to_owned();
    ensure!(matches!(mode.as_str(), "namespaces" | "host"), "{mode}");
    Ok(mode == "namespaces")
}

fn init_and_sidecars(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&pod(
        "initpod",
        NS,
        "proc",
        r#"  terminationGracePeriodSeconds: 3
  initContainers:
  - name: setup
    image: busybox
    command: [sh, -c, "echo init says hi; sleep 4"]
  - name: proxy
    image: busybox
    restartPolicy: Always
    command: [sh, -c, "sleep 3600; : marker-initpod"]
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "trap 'printf stopped > dev/termination-log; exit 0' TERM; sleep 3600 & wait; : marker-initpod"]"#,
    ))?;
    c.kubectl(&[
        "patch",
        "pod",
        "initpod",
        "-n",
        NS,
        "--type=merge",
        "-p",
        r#"{"metadata":{"finalizers":["vkd.io/e2e-hold"]}}"#,
    ])?;
    c.apply(&pod(
        "initfail",
        NS,
        "proc",
        r#"  restartPolicy: Never
  initContainers:
  - name: check
    image: busybox
    terminationMessagePolicy: FallbackToLogsOnError
    command: [sh, -c, "echo config missing; exit 3"]
  containers:
  - name: main
    image: busybox
    command: [sleep, "60"]"#,
    ))?;
    c.apply(&pod(
        "initloop",
        NS,
        "proc",
        r#"  initContainers:
  - name: check
    image: busybox
    command: [sh, -c, "exit 1"]
  containers:
  - name: main
    image: busybox
    command: [sleep, "60"]"#,
    ))?;
    let p = wait_for("initpod initializing", Duration::from_secs(60), || {
        let p = get(c, "initpod")?;
        let running = at(&p, "status.initContainerStatuses")[0]["state"]["running"].is_object();
        Ok(running.then_some(p))
    })?;
    let (_, status) = ready_and_status(c, "initpod")?;
    ensure!(status == "Init:0/2", "kubectl shows {status}");
    let init = condition_of(&p, "Initialized");
    ensure!(init["status"] == "False", "{init}");
    ensure!(
        init["message"] == "containers with incomplete status: [setup proxy]",
        "{init}"
    );
    let main = &container_status(&p)["state"]["waiting"];
    ensure!(main["reason"] == "PodInitializing", "{main}");
    let p = wait_running(c, "initpod")?;
    let (ready, _) = ready_and_status(c, "initpod")?;
    ensure!(ready == "2/2", "the sidecar counts toward READY: {ready}");
    let setup = &at(&p, "status.initContainerStatuses")[0];
    ensure!(
        setup["state"]["terminated"]["exitCode"] == 0 && setup["ready"] == true,
        "{setup}"
    );
    ensure!(condition_of(&p, "Initialized")["status"] == "True");
    let log = c.kubectl(&["logs", "initpod", "-n", NS, "-c", "setup"])?;
    ensure!(log.trim_end() == "init says hi", "{log:?}");

    wait_for("Init:Error", Duration::from_secs(60), || {
        Ok((ready_and_status(c, "initfail")?.1 == "Init:Error").then_some(()))
    })?;
    let p = get(c, "initfail")?;
    ensure!(str_at(&p, "status.phase") == "Failed");
    let t = &at(&p, "status.initContainerStatuses")[0]["state"]["terminated"];
    ensure!(t["message"] == "config missing\n", "{t}");
    ensure!(
        container_status(&p)["state"]["waiting"]["reason"] == "PodInitializing",
        "{p}"
    );
    wait_for("Init:CrashLoopBackOff", Duration::from_secs(60), || {
        Ok((ready_and_status(c, "initloop")?.1 == "Init:CrashLoopBackOff").then_some(()))
    })?;
    ensure!(str_at(&get(c, "initloop")?, "status.phase") == "Pending");

    // Deletion: the finalizer keeps the Pod, with its containers' ends.
    c.kubectl(&["delete", "pod", "initpod", "-n", NS, "--wait=false"])?;
    let p = wait_for("the final status", Duration::from_secs(60), || {
        let p = get(c, "initpod")?;
        Ok((str_at(&p, "status.phase") == "Succeeded").then_some(p))
    })?;
    let main = &container_status(&p)["state"]["terminated"];
    ensure!(main["exitCode"] == 0 && main["message"] == "stopped", "{p}");
    let proxy = &at(&p, "status.initContainerStatuses")[1]["state"]["terminated"];
    // In its own PID namespace the sidecar's sh is init: it ignores SIGTERM,
    // as under a runtime, and is killed when the grace period ends.
    let stopped_by = if namespaces(c)? { 137 } else { 143 };
    ensure!(proxy["exitCode"] == stopped_by, "{p}");
    ensure!(processes_with("marker-initpod")?.is_empty());
    c.kubectl(&[
        "patch",
        "pod",
        "initpod",
        "-n",
        NS,
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/metadata/finalizers"}]"#,
    ])?;
    for name in ["initfail", "initloop"] {
        delete_now(c, name)?;
    }
    wait_for("initpod gone", Duration::from_secs(60), || {
        let out = c.kubectl(&["get", "pods", "-n", NS, "-o", "name"])?;
        Ok((!out.contains("pod/initpod")).then_some(()))
    })?;
    Ok(())
}

fn bad_input(c: &Cluster) -> Result<()> {
    let state = vkd(c)?;
    let cases = [
        (
            "no-such-command",
            NS,
            "ExecutableNotFound",
            "  containers:\n  - {name: main, image: busybox, command: [definitely-not-a-program]}",
        ),
        (
            "nfs-volume",
            NS,
            "UnsupportedVolume",
            "  volumes: [{name: data, nfs: {server: nfs.invalid, path: /export}}]\n  containers:\n  - {name: main, image: busybox, command: [sleep, '60']}",
        ),
        (
            "bad-probe",
            NS,
            "InvalidProbe",
            "  containers:\n  - name: main\n    image: busybox\n    command: [sleep, '60']\n    readinessProbe: {httpGet: {port: nosuch}}",
        ),
        (
            "other-namespace",
            "proc-denied",
            "NamespaceNotAllowed",
            "  containers:\n  - {name: main, image: busybox, command: [sleep, '60']}",
        ),
    ];
    for (name, ns, _, body) in &cases {
        c.apply(&pod(name, ns, "proc", body))?;
    }
    let mut uids = Vec::new();
    for (name, ns, reason, _) in &cases {
        let p = wait_for(&format!("{name} to fail"), Duration::from_secs(60), || {
            let p = c.kubectl_json(&["get", "pod", name, "-n", ns])?;
            Ok((at(&p, "status.phase") == "Failed").then_some(p))
        })?;
        ensure!(
            at(&p, "status.reason") == *reason,
            "{name}: {}",
            at(&p, "status")
        );
        let message = str_at(&p, "status.message");
        ensure!(!message.is_empty(), "{name}: no message");
        uids.push(str_at(&p, "metadata.uid").to_owned());
        eprintln!("bad input {name}: {reason}: {message}");
    }
    // An image the node cannot run is a failed pull: the Pod waits, saying
    // why, and runs once its image is fixed.
    c.apply(&pod(
        "unknown-image",
        NS,
        "proc",
        "  containers:\n  - {name: main, image: nginx:1.27, command: [sleep, '60']}",
    ))?;
    let p = wait_for(
        "unknown-image to wait for its image",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "unknown-image", "-n", NS])?;
            let reason = at(&p, "status.containerStatuses.0.state.waiting.reason");
            Ok((reason == "ErrImagePull" || reason == "ImagePullBackOff").then_some(p))
        },
    )?;
    ensure!(at(&p, "status.phase") == "Pending", "{}", at(&p, "status"));
    ensure!(
        str_at(&p, "status.containerStatuses.0.state.waiting.message").contains("nginx"),
        "{}",
        at(&p, "status")
    );
    let waiting_uid = str_at(&p, "metadata.uid").to_owned();
    ensure!(
        !state.join("process/pods").join(&waiting_uid).exists(),
        "a sandbox was made for an image the node cannot run"
    );
    c.kubectl(&[
        "set",
        "image",
        "pod/unknown-image",
        "main=busybox",
        "-n",
        NS,
    ])?;
    wait_for(
        "unknown-image to run once fixed",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "unknown-image", "-n", NS])?;
            Ok(running_and_ready(&p).then_some(()))
        },
    )?;
    c.kubectl(&[
        "delete",
        "pod",
        "unknown-image",
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    // Nothing was started for any of them: no sandbox and no process.
    for uid in &uids {
        let sandbox = state.join("process/pods").join(uid);
        ensure!(
            !sandbox.exists(),
            "a sandbox was made: {}",
            sandbox.display()
        );
    }
    for (name, ns, _, _) in &cases {
        c.kubectl(&[
            "delete",
            "pod",
            name,
            "-n",
            ns,
            "--wait=true",
            "--timeout=60s",
        ])?;
    }
    ensure!(
        processes_with("definitely-not-a-program")?.is_empty(),
        "a process leaked"
    );
    Ok(())
}

/// What the kubelet gives a container and how it ends a Pod: service
/// variables from the cached Service watch (RBAC included), a Warning `Failed`
/// Event with the kubelet's words for a container it cannot configure, and an
/// `activeDeadlineSeconds` set on a running Pod that stops it.
fn kubelet_semantics(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: fooservice, namespace: {NS}}}
spec: {{ports: [{{port: 8765, targetPort: 8080}}]}}
"#
    ))?;
    let svc = c.kubectl_json(&["get", "service", "fooservice", "-n", NS])?;
    let ip = str_at(&svc, "spec.clusterIP").to_owned();
    let master = c.kubectl_json(&["get", "service", "kubernetes", "-n", "default"])?;
    let master_ip = str_at(&master, "spec.clusterIP").to_owned();
    c.apply(&pod(
        "deadline",
        NS,
        "proc",
        // Its sh ignores SIGTERM (as its PID namespace's init, or under a
        // runtime), so the grace period is what stopping it takes.
        r#"  terminationGracePeriodSeconds: 3
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "sleep 3600; : marker-deadline"]"#,
    ))?;
    for (name, env, mount) in [
        (
            "bad-subpath",
            "[{name: UP, value: '..'}]",
            "[{name: w, mountPath: /w, subPathExpr: '$(UP)'}]",
        ),
        (
            "no-secret",
            "[{name: X, valueFrom: {secretKeyRef: {name: nosuch, key: k}}}]",
            "[]",
        ),
    ] {
        c.apply(&pod(
            name,
            NS,
            "proc",
            &format!(
                "  volumes: [{{name: w, emptyDir: {{}}}}]\n  containers:\n  - {{name: main, image: busybox, \
                 command: [sleep, '60'], env: {env}, volumeMounts: {mount}}}"
            ),
        ))?;
    }
    wait_running(c, "deadline")?;
    let out = c.kubectl(&[
        "exec",
        "deadline",
        "-n",
        NS,
        "--",
        "sh",
        "-c",
        "echo $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT; \
         echo $FOOSERVICE_SERVICE_HOST $FOOSERVICE_SERVICE_PORT $FOOSERVICE_PORT_8765_TCP",
    ])?;
    let lines: Vec<&str> = out.lines().collect();
    ensure!(
        lines.first() == Some(&format!("{master_ip} 443").as_str()),
        "{out:?}"
    );
    ensure!(
        lines.get(1) == Some(&format!("{ip} 8765 tcp://{ip}:8765").as_str()),
        "{out:?}"
    );
    for (name, message) in [
        (
            "bad-subpath",
            "unable to provision SubPath `..`: must not contain '..'",
        ),
        ("no-secret", "secret \"nosuch\" not found"),
    ] {
        let waiting = wait_for(
            &format!("{name} to wait with CreateContainerConfigError"),
            Duration::from_secs(30),
            || {
                let p = get(c, name)?;
                let w = at(&container_status(&p), "state.waiting").clone();
                Ok((w["reason"] == "CreateContainerConfigError").then_some(w))
            },
        )?;
        ensure!(waiting["message"] == message, "{name}: {waiting}");
        let note = format!("Error: {message}");
        wait_for(
            &format!("the Failed event of {name}"),
            Duration::from_secs(30),
            || {
                let events = c.kubectl_json(&["get", "events.events.k8s.io", "-n", NS])?;
                Ok(common::items(&events)
                    .iter()
                    .any(|e| {
                        e["regarding"]["name"] == name
                            && e["type"] == "Warning"
                            && e["reason"] == "Failed"
                            && e["note"] == note
                    })
                    .then_some(()))
            },
        )?;
    }
    // The deadline is mutable: set on a running Pod, it ends it.
    c.kubectl(&[
        "patch",
        "pod",
        "deadline",
        "-n",
        NS,
        "-p",
        r#"{"spec":{"activeDeadlineSeconds":2}}"#,
    ])?;
    let p = wait_for("deadline to fail", Duration::from_secs(30), || {
        let p = get(c, "deadline")?;
        Ok((at(&p, "status.phase") == "Failed").then_some(p))
    })?;
    ensure!(
        at(&p, "status.reason") == "DeadlineExceeded"
            && at(&p, "status.message")
                == "Pod was active on the node longer than the specified deadline",
        "{}",
        at(&p, "status")
    );
    ensure!(
        condition(&p, "Ready").is_some_and(|c| c["status"] == "False"),
        "{}",
        at(&p, "status")
    );
    wait_for(
        "the deadline Pod's process to end",
        Duration::from_secs(30),
        || Ok(processes_with("marker-deadline")?.is_empty().then_some(())),
    )?;
    for name in ["deadline", "bad-subpath", "no-secret"] {
        delete_now(c, name)?;
    }
    c.kubectl(&["delete", "service", "fooservice", "-n", NS])?;
    Ok(())
}

fn adoption(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.namespace("proc-kill")?;
    let mut own = Vkd::start_process(c, "vk-proc-kill", &["--node-label", "vkd.io/e2e=proc-kill"])?;
    let result = (|| -> Result<()> {
        for name in ["survivor", "doomed"] {
            c.apply(&pod(
                name,
                "proc-kill",
                "proc-kill",
                &format!(
                    "  containers:\n  - {{name: main, image: busybox, command: [sh, -c, 'sleep 3600; : marker-{name}']}}"
                ),
            ))?;
        }
        let get = |name: &str| c.kubectl_json(&["get", "pod", name, "-n", "proc-kill"]);
        for name in ["survivor", "doomed"] {
            wait_for(&format!("{name} Ready"), Duration::from_secs(60), || {
                Ok(running_and_ready(&get(name)?).then_some(()))
            })?;
        }
        let before = processes_with("marker-survivor")?;
        ensure!(before.len() == 1, "{before:?}");
        let instance = instance_id(&get("survivor")?);
        own.kill()?;
        // vkd is gone; its processes are not.
        std::thread::sleep(Duration::from_secs(2));
        let during = processes_with("marker-survivor")?;
        ensure!(
            during == before,
            "the process did not survive vkd: {during:?} vs {before:?}"
        );
        // A Pod removed while vkd is down must not keep running afterwards.
        c.kubectl(&[
            "delete",
            "pod",
            "doomed",
            "-n",
            "proc-kill",
            "--grace-period=0",
            "--force",
        ])?;
        ensure!(
            processes_with("marker-doomed")?.len() == 1,
            "doomed stopped before vkd came back"
        );
        let restarted = Instant::now();
        own.spawn()?;
        wait_for(
            "the doomed process to be killed",
            Duration::from_secs(60),
            || Ok(processes_with("marker-doomed")?.is_empty().then_some(())),
        )?;
        let p = wait_for(
            "survivor Ready after the restart",
            Duration::from_secs(60),
            || {
                let p = get("survivor")?;
                Ok(running_and_ready(&p).then_some(p))
            },
        )?;
        std::thread::sleep(Duration::from_secs(3));
        let after = processes_with("marker-survivor")?;
        ensure!(
            after == before,
            "a second copy or a replacement: {after:?} vs {before:?}"
        );
        let p2 = get("survivor")?;
        ensure!(instance_id(&p2) == instance, "instance changed");
        ensure!(
            container_status(&p2)["restartCount"] == 0,
            "restarted: {}",
            container_status(&p2)
        );
        eprintln!(
            "adoption: pid {} kept through SIGKILL of vkd, doomed killed and survivor Ready {:.1}s after restart",
            before[0].0,
            restarted.elapsed().as_secs_f64()
        );
        let _ = p;
        c.kubectl(&[
            "delete",
            "pod",
            "survivor",
            "-n",
            "proc-kill",
            "--wait=true",
            "--timeout=60s",
        ])?;
        ensure!(
            processes_with("marker-survivor")?.is_empty(),
            "survivor outlived its Pod"
        );
        Ok(())
    })();
    own.kill()?;
    own.reap_processes();
    result
}

/// The ephemeral container named `name` in the Pod's status, once `done` says so.
fn wait_ephemeral(
    c: &Cluster,
    pod: &str,
    name: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Result<Value> {
    wait_for(
        &format!("ephemeral container {name} {what}"),
        Duration::from_secs(60),
        || {
            let p = get(c, pod)?;
            let s = at(&p, "status.ephemeralContainerStatuses")
                .as_array()
                .and_then(|a| a.iter().find(|s| s["name"] == name))
                .cloned();
            Ok(s.filter(|s| done(s)))
        },
    )
}

/// `kubectl debug` adds an ephemeral container (the pods/ephemeralcontainers
/// subresource): it runs once in the Pod's sandbox as its user, `kubectl logs
/// -c` shows it, `kubectl exec -c` reaches it while it runs (as the conformance
/// spec "will start an ephemeral container in an existing pod" does), its end
/// is in ephemeralContainerStatuses, one that cannot run here says why, and
/// what still runs ends with the Pod.
fn ephemeral_containers(c: &Cluster) -> Result<()> {
    vkd(c)?;
    let name = "debug-target";
    c.apply(&pod(
        name,
        NS,
        "proc",
        r#"  containers:
  - name: main
    image: busybox
    command: [sh, -c, "sleep 3600; : marker-debug-target"]"#,
    ))?;
    wait_running(c, name)?;
    // kubectl's default profile (`general`) adds SYS_PTRACE, which the node
    // policy refuses without --allow-privileged (shown below); `baseline` adds nothing.
    let debug_as = |profile: &str, container: &str, image: &str, command: &[&str]| {
        let image = format!("--image={image}");
        let profile = format!("--profile={profile}");
        let mut args = vec![
            "debug",
            name,
            "-n",
            NS,
            &image,
            &profile,
            "-c",
            container,
            "--target=main",
            "--",
        ];
        args.extend_from_slice(command);
        c.kubectl(&args)
    };
    let debug = |container: &str, image: &str, command: &[&str]| -> Result<String> {
        debug_as("baseline", container, image, command)
    };
    debug(
        "debugger",
        "busybox",
        &["sh", "-c", "echo hi from $(id -u)"],
    )?;
    let s = wait_ephemeral(c, name, "debugger", "to end", |s| {
        s["state"]["terminated"].is_object()
    })?;
    let t = &s["state"]["terminated"];
    ensure!(t["exitCode"] == 0 && t["reason"] == "Completed", "{s}");
    ensure!(s["image"] == "busybox", "{s}");
    ensure!(str_at(&s, "containerID").starts_with("process://"), "{s}");
    let me = rustix_uid();
    let want = if me == 0 { 65534 } else { me };
    let logs = c.kubectl(&["logs", name, "-n", NS, "-c", "debugger"])?;
    ensure!(logs.trim_end() == format!("hi from {want}"), "{logs:?}");

    // In its target's PID namespace (with namespaces): the target's program
    // is its PID 1, and none of the host's processes is in view.
    debug(
        "looker",
        "busybox",
        &[
            "sh",
            "-c",
            "tr '\\0' ' ' < /proc/1/cmdline; echo; ls /proc | grep -c '^[0-9]'",
        ],
    )?;
    wait_ephemeral(c, name, "looker", "to end", |s| {
        s["state"]["terminated"].is_object()
    })?;
    let seen = c.kubectl(&["logs", name, "-n", NS, "-c", "looker"])?;
    if me == 0 {
        let mut lines = seen.lines();
        let init = lines.next().unwrap_or_default();
        ensure!(init.contains("marker-debug-target"), "{seen:?}");
        let count: usize = lines.next().unwrap_or_default().trim().parse()?;
        ensure!(count < 10, "the host's processes are in view: {seen:?}");
    }

    // As the conformance spec: one that keeps running, exec'd into.
    debug(
        "poller",
        "busybox",
        &["sh", "-c", "while true; do echo polo; sleep 1; done"],
    )?;
    wait_ephemeral(c, name, "poller", "to run", |s| {
        s["state"]["running"].is_object()
    })?;
    let out = c.kubectl(&[
        "exec", name, "-n", NS, "-c", "poller", "--", "echo", "marco",
    ])?;
    ensure!(out.contains("marco"), "{out:?}");
    wait_for("polo in the poller's log", Duration::from_secs(30), || {
        let logs = c.kubectl(&["logs", name, "-n", NS, "-c", "poller"])?;
        Ok(logs.contains("polo").then_some(()))
    })?;
    let p = get(c, name)?;
    ensure!(
        running_and_ready(&p),
        "an ephemeral container changed the Pod's readiness: {}",
        at(&p, "status")
    );

    // An image this node cannot run: it waits, saying why, with a Warning Event.
    debug("nope", "nginx", &["true"])?;
    let s = wait_ephemeral(c, name, "nope", "to wait with a reason", |s| {
        s["state"]["waiting"]["reason"] == "ErrImagePull"
    })?;
    ensure!(str_at(&s, "state.waiting.message").contains("nginx"), "{s}");
    wait_for("the Failed event of nope", Duration::from_secs(30), || {
        let events = c.kubectl_json(&["get", "events.events.k8s.io", "-n", NS])?;
        Ok(common::items(&events)
            .iter()
            .any(|e| {
                e["regarding"]["name"] == name
                    && e["type"] == "Warning"
                    && e["reason"] == "Failed"
                    && str_at(e, "note").contains("ephemeral container nope")
            })
            .then_some(()))
    })?;

    // A capability beyond the runtime's default set: refused by the node policy.
    debug_as("general", "tracer", "busybox", &["true"])?;
    let s = wait_ephemeral(c, name, "tracer", "to wait with a reason", |s| {
        s["state"]["waiting"]["reason"] == "CapabilitiesNotAllowed"
    })?;
    ensure!(
        str_at(&s, "state.waiting.message").contains("SYS_PTRACE"),
        "{s}"
    );

    delete_now(c, name)?;
    ensure!(
        processes_with("echo polo")?.is_empty(),
        "the ephemeral container outlived its Pod"
    );
    Ok(())
}

/// `kubectl attach -i` to `name`'s container `main` in `ns`: sends `input` and
/// waits for `expect` in what comes back, then hangs up. `spdy` picks the
/// older protocol (kubectl uses WebSocket unless told otherwise).
fn attach_echo(
    c: &Cluster,
    ns: &str,
    name: &str,
    input: &str,
    expect: &str,
    spdy: bool,
) -> Result<()> {
    let mut cmd = kubectl_cmd(c)?;
    if spdy {
        cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false");
    }
    let mut child = cmd
        .args(["attach", "-i", name, "-n", ns, "-c", "main"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().context("kubectl's stdout")?;
    let mut stderr = child.stderr.take().context("kubectl's stderr")?;
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut stdin = child.stdin.take().context("kubectl's stdin")?;
    let outcome = (|| -> Result<()> {
        use std::io::Write;
        // Sent until it comes back: the first line may go before the session is up.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            stdin
                .write_all(input.as_bytes())
                .and_then(|()| stdin.flush())?;
            while let Ok(line) = rx.recv_timeout(Duration::from_secs(2)) {
                if line.contains(expect) {
                    return Ok(());
                }
                seen.push(line);
            }
        }
        anyhow::bail!("no {expect:?} back through attach (spdy: {spdy}); saw {seen:?}")
    })();
    let _ = child.kill();
    let _ = child.wait();
    let errors = errors.join().unwrap_or_default();
    outcome.with_context(|| format!("kubectl attach (spdy: {spdy}) said: {}", errors.trim()))
}

/// `kubectl run -i` as a user types it: runs `name` in `proc-attach` with
/// `input` on its stdin, which then ends, and returns what kubectl printed.
/// kubectl must return by itself: with stdinOnce (the default of `-i`) once
/// the container has read the end of its stdin and ended, with
/// `--leave-stdin-open` once its own stdin has ended (the session detaches).
fn kubectl_run_i(
    c: &Cluster,
    name: &str,
    input: &str,
    leave_open: bool,
    spdy: bool,
) -> Result<String> {
    use std::io::Write;
    let overrides = r#"{"apiVersion":"v1","spec":{"nodeSelector":{"vkd.io/e2e":"proc-attach"},"tolerations":[{"key":"virtual-kubelet.io/provider","operator":"Exists"}]}}"#;
    let mut cmd = kubectl_cmd(c)?;
    if spdy {
        cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false");
    }
    cmd.args([
        "run",
        name,
        "-n",
        "proc-attach",
        "--image=busybox",
        "--restart=OnFailure",
    ])
    .args(["--attach=true", "--stdin", "--pod-running-timeout=2m"])
    .arg(format!("--leave-stdin-open={leave_open}"))
    .args(["--overrides", overrides, "--"])
    .args(["sh", "-c", "echo -n read: && cat && echo 'stdin closed'"])
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let mut stdin = child.stdin.take().context("kubectl's stdin")?;
    stdin.write_all(input.as_bytes())?;
    drop(stdin);
    let deadline = Instant::now() + Duration::from_secs(90);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!(
                "kubectl run -i (spdy: {spdy}, leave-stdin-open: {leave_open}) did not return in 90 s"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "kubectl run -i (spdy: {spdy}) failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn attach(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.namespace("proc-attach")?;
    // Its own vkd, to kill and restart without disturbing the other tests.
    let ca = c
        .env("VKD_E2E_KUBELET_CLIENT_CA")
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .to_owned();
    let mut own = Vkd::start_process(
        c,
        "vk-proc-attach",
        &[
            "--node-label",
            "vkd.io/e2e=proc-attach",
            "--client-ca-file",
            &ca,
        ],
    )?;
    let result = (|| -> Result<()> {
        c.apply(&pod(
            "talkback",
            "proc-attach",
            "proc-attach",
            r#"  containers:
  - name: main
    image: busybox
    stdin: true
    command: [sh, -c, 'while read line; do echo "echo:$line"; done']"#,
        ))?;
        let get = || c.kubectl_json(&["get", "pod", "talkback", "-n", "proc-attach"]);
        wait_for("talkback Ready", Duration::from_secs(60), || {
            Ok(running_and_ready(&get()?).then_some(()))
        })?;
        attach_echo(c, "proc-attach", "talkback", "ws-1\n", "echo:ws-1", false)?;
        attach_echo(
            c,
            "proc-attach",
            "talkback",
            "spdy-1\n",
            "echo:spdy-1",
            true,
        )?;
        // vkd dies and comes back: the shim kept the container's stdin.
        own.kill()?;
        own.spawn()?;
        let port = own.kubelet_port;
        wait_for("vkd's kubelet API again", Duration::from_secs(60), || {
            Ok(std::net::TcpStream::connect(("127.0.0.1", port))
                .is_ok()
                .then_some(()))
        })?;
        attach_echo(c, "proc-attach", "talkback", "ws-2\n", "echo:ws-2", false)?;
        attach_echo(
            c,
            "proc-attach",
            "talkback",
            "spdy-2\n",
            "echo:spdy-2",
            true,
        )?;
        let p = get()?;
        ensure!(
            container_status(&p)["restartCount"] == 0,
            "the container restarted: {}",
            container_status(&p)
        );
        eprintln!(
            "attach -i: echoed over WebSocket and SPDY, before and after SIGKILL and restart of vkd"
        );
        // `kubectl run -i`: with stdinOnce the container reads to the end of
        // what was piped in and ends; with --leave-stdin-open kubectl returns
        // at the end of its input and the container keeps reading.
        for spdy in [false, true] {
            let name = if spdy { "run-i-spdy" } else { "run-i-ws" };
            kubectl_run_i(c, name, "value\nabcd1234", false, spdy)?;
            let log = c.kubectl(&["logs", name, "-n", "proc-attach"])?;
            ensure!(
                log.contains("read:value") && log.contains("abcd1234stdin closed"),
                "{name}: {log:?}"
            );
            let open = format!("{name}-open");
            kubectl_run_i(c, &open, "abcd1234\n", true, spdy)?;
            let p = c.kubectl_json(&["get", "pod", &open, "-n", "proc-attach"])?;
            ensure!(
                running_and_ready(&p),
                "{open} did not keep running: {}",
                p["status"]
            );
            wait_for(
                "the line fed before the end",
                Duration::from_secs(30),
                || {
                    let log = c.kubectl(&["logs", &open, "-n", "proc-attach"])?;
                    ensure!(
                        !log.contains("stdin closed"),
                        "{open}: stdin closed: {log:?}"
                    );
                    Ok(log.contains("abcd1234").then_some(()))
                },
            )?;
        }
        eprintln!(
            "kubectl run -i: returns over WebSocket and SPDY, with and without --leave-stdin-open"
        );
        c.kubectl(&[
            "delete",
            "pods",
            "--all",
            "-n",
            "proc-attach",
            "--wait=true",
            "--timeout=60s",
        ])?;
        Ok(())
    })();
    own.reap_processes();
    result
}

/// What workload controllers read from the node, as over a kubelet: a
/// StatefulSet's rolling update and its rollback replace each Pod in turn
/// and end with every replica Ready at the revision asked for; a Job whose
/// container fails once (`restartPolicy: OnFailure`) is restarted in place,
/// keeps its emptyDir across the restart, and completes with one Pod.
fn workload_controllers(c: &Cluster) -> Result<()> {
    vkd(c)?;
    let sts = |version: &str| {
        format!(
            r#"
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: web, namespace: {NS}}}
spec:
  replicas: 2
  serviceName: web
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      nodeSelector: {{vkd.io/e2e: proc}}
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
      terminationGracePeriodSeconds: 2
      containers:
      - name: main
        image: busybox
        command: [sh, -c, "echo serving $VERSION; exec sleep 3600"]
        env: [{{name: VERSION, value: {version}}}]
        readinessProbe:
          exec: {{command: [sh, -c, "test $VERSION = {version}"]}}
          periodSeconds: 1
"#
        )
    };
    let rolled = |version: &str| -> Result<()> {
        c.kubectl(&[
            "rollout",
            "status",
            "statefulset/web",
            "-n",
            NS,
            "--timeout=180s",
        ])?;
        let set = c.kubectl_json(&["get", "statefulset", "web", "-n", NS])?;
        let status = at(&set, "status");
        ensure!(
            status["readyReplicas"] == 2
                && status["updatedReplicas"] == 2
                && status["currentRevision"] == status["updateRevision"],
            "the StatefulSet did not settle at {version}: {status}"
        );
        for pod in ["web-0", "web-1"] {
            let p = get(c, pod)?;
            ensure!(running_and_ready(&p), "{pod}: {}", at(&p, "status"));
            let env = at(&p, "spec.containers")[0]["env"][0]["value"].clone();
            ensure!(env == version, "{pod} runs {env}, not {version}");
            ensure!(
                at(&p, "metadata.labels")["controller-revision-hash"] == status["updateRevision"],
                "{pod} is not at the update revision"
            );
            let log = c.kubectl(&["logs", pod, "-n", NS])?;
            ensure!(
                log.contains(&format!("serving {version}")),
                "{pod}: {log:?}"
            );
        }
        Ok(())
    };
    c.apply(&sts("v1"))?;
    rolled("v1")?;
    let first = get(c, "web-0")?;
    c.apply(&sts("v2"))?;
    rolled("v2")?;
    ensure!(
        str_at(&get(c, "web-0")?, "metadata.uid") != str_at(&first, "metadata.uid"),
        "web-0 was not replaced by the rolling update"
    );
    c.kubectl(&["rollout", "undo", "statefulset/web", "-n", NS])?;
    rolled("v1")?;
    eprintln!("StatefulSet: v1 -> v2 -> undo -> v1, each replica replaced in turn");
    c.kubectl(&[
        "delete",
        "statefulset",
        "web",
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;

    c.apply(&format!(
        r#"
apiVersion: batch/v1
kind: Job
metadata: {{name: retry, namespace: {NS}}}
spec:
  backoffLimit: 3
  template:
    spec:
      nodeSelector: {{vkd.io/e2e: proc}}
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
      restartPolicy: OnFailure
      containers:
      - name: main
        image: busybox
        command: [sh, -c, "if [ -f /scratch/tried ]; then echo second try kept $(cat /scratch/tried); exit 0; fi; echo first > /scratch/tried; echo first try fails; exit 3"]
        volumeMounts: [{{name: scratch, mountPath: /scratch}}]
      volumes: [{{name: scratch, emptyDir: {{}}}}]
"#
    ))?;
    c.kubectl(&[
        "wait",
        "--for=condition=complete",
        "job/retry",
        "-n",
        NS,
        "--timeout=120s",
    ])?;
    let pods = items(&c.kubectl_json(&["get", "pods", "-n", NS, "-l", "job-name=retry"])?);
    ensure!(pods.len() == 1, "the Job made {} Pods, not one", pods.len());
    let p = &pods[0];
    let cs = container_status(p);
    ensure!(
        str_at(p, "status.phase") == "Succeeded" && cs["restartCount"] == 1,
        "{}",
        at(p, "status")
    );
    ensure!(
        cs["state"]["terminated"]["exitCode"] == 0
            && cs["lastState"]["terminated"]["exitCode"] == 3,
        "{cs}"
    );
    let name = str_at(p, "metadata.name").to_owned();
    let log = c.kubectl(&["logs", &name, "-n", NS])?;
    ensure!(
        log.contains("second try kept first"),
        "the emptyDir was lost: {log:?}"
    );
    let job = c.kubectl_json(&["get", "job", "retry", "-n", NS])?;
    ensure!(
        at(&job, "status")["succeeded"] == 1 && at(&job, "status")["failed"].is_null(),
        "{}",
        at(&job, "status")
    );
    eprintln!("Job: failed once, restarted in place with its emptyDir, completed");
    c.kubectl(&[
        "delete",
        "job",
        "retry",
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    Ok(())
}
