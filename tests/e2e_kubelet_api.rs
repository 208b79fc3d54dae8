//! End-to-end: the kubelet API through the real apiserver and kubectl. The
//! apiserver presents its kubelet client certificate; vkd requires client
//! certificates from that CA (or a bearer token it reviews).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, wait_for};

mod common;
use common::{Vkd, running_and_ready, str_at};

fn main() -> ExitCode {
    let code = Suite::new("kubelet-api", &[]).run(&[
        ("logs_with_each_parameter", logs_with_each_parameter),
        (
            "logs_follow_streams_and_ends_with_the_container",
            logs_follow,
        ),
        ("exec_over_websocket_and_spdy", exec_both_protocols),
        ("attach_streams_the_container", attach),
        ("exec_tty_carries_the_terminal_size", exec_tty),
        ("port_forward_carries_tcp", port_forward),
        (
            "port_forward_ends_when_the_pod_side_closes",
            port_forward_pod_side_close,
        ),
        (
            "exec_over_older_websocket_protocols",
            exec_older_websocket_protocols,
        ),
        (
            "port_forward_over_websocket_channels",
            port_forward_websocket_channels,
        ),
        ("logs_over_http2_and_websocket", logs_http2_and_websocket),
        (
            "stats_and_pod_lists_with_a_client_certificate",
            stats_with_cert,
        ),
        (
            "no_credentials_401_and_unauthorized_token_403",
            auth_refusals,
        ),
    ]);
    drop(VKD.lock().unwrap_or_else(|p| p.into_inner()).take());
    code
}

const NS: &str = "kapi";
const NODE: &str = "vk-kapi";

/// One vkd for the suite, started by the first test that needs it; killed after the suite.
static VKD: Mutex<Option<std::result::Result<Vkd, String>>> = Mutex::new(None);

/// Starts the suite's vkd if needed; returns its kubelet port.
fn vkd(c: &Cluster) -> Result<u16> {
    let mut slot = VKD.lock().unwrap_or_else(|p| p.into_inner());
    let v = slot.get_or_insert_with(|| start(c).map_err(|e| format!("{e:#}")));
    v.as_ref()
        .map(|v| v.kubelet_port)
        .map_err(|e| anyhow::anyhow!("vkd did not start: {e}"))
}

fn start(c: &Cluster) -> Result<Vkd> {
    let ca = c.env("VKD_E2E_KUBELET_CLIENT_CA")?.to_owned();
    let vkd = Vkd::start(
        c,
        NODE,
        &["--node-label", "vkd.io/e2e=kapi", "--client-ca-file", &ca],
    )?;
    c.namespace(NS)?;
    for (name, annotations, policy) in [
        ("steady", "sim.vkd.io/log-interval: 200ms", "Always"),
        (
            "crashy",
            "{sim.vkd.io/behavior: crash-loop, sim.vkd.io/run-for: 1s, sim.vkd.io/log-interval: 200ms}",
            "Always",
        ),
    ] {
        let annotations = if annotations.starts_with('{') {
            annotations.to_owned()
        } else {
            format!("{{{annotations}}}")
        };
        c.apply(&pod(name, &annotations, policy))?;
    }
    wait_for("the steady Pod to run", Duration::from_secs(60), || {
        let p = c.kubectl_json(&["get", "pod", "steady", "-n", NS])?;
        Ok(running_and_ready(&p).then_some(()))
    })?;
    Ok(vkd)
}

fn pod(name: &str, annotations: &str, policy: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}, annotations: {annotations}}}
spec:
  restartPolicy: {policy}
  nodeSelector: {{vkd.io/e2e: kapi}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: main
    image: example/main:1
    env: [{{name: GREETING, value: hello}}]
    resources: {{requests: {{cpu: 500m, memory: 256Mi}}}}
"#
    )
}

fn line_numbers(text: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

fn logs_with_each_parameter(c: &Cluster) -> Result<()> {
    vkd(c)?;
    std::thread::sleep(Duration::from_secs(2));
    let all = c.kubectl(&["logs", "steady", "-n", NS])?;
    let n = line_numbers(&all);
    ensure!(n.len() >= 8, "few lines: {all:?}");
    ensure!(
        n.windows(2).all(|w| w[1] == w[0] + 1),
        "lines out of order: {n:?}"
    );
    ensure!(
        all.starts_with(&format!("sim: {NS}/steady main line 0\n")),
        "{all:?}"
    );

    let tail = c.kubectl(&["logs", "steady", "-n", NS, "--tail=3"])?;
    ensure!(line_numbers(&tail).len() == 3, "--tail=3 gave {tail:?}");

    let stamped = c.kubectl(&["logs", "steady", "-n", NS, "--timestamps", "--tail=1"])?;
    let stamp = stamped.split(' ').next().unwrap_or_default();
    ensure!(
        stamp.len() == "2026-12-02T11:04:05.123456789Z".len()
            && stamp.parse::<jiff::Timestamp>().is_ok(),
        "--timestamps gave {stamped:?}"
    );

    let limited = c.kubectl(&["logs", "steady", "-n", NS, "--limit-bytes=10"])?;
    ensure!(limited == "sim: kapi/", "--limit-bytes=10 gave {limited:?}");

    let since = c.kubectl(&["logs", "steady", "-n", NS, "--since=1s"])?;
    let count = line_numbers(&since).len();
    ensure!(
        (3..=7).contains(&count),
        "--since=1s gave {count} lines at 200ms each: {since:?}"
    );

    let t = jiff::Timestamp::try_from(SystemTime::now() - Duration::from_secs(2))?
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    let since_time = c.kubectl(&["logs", "steady", "-n", NS, &format!("--since-time={t}")])?;
    let count = line_numbers(&since_time).len();
    ensure!(
        (5..=16).contains(&count),
        "--since-time gave {count} lines: {since_time:?}"
    );

    // --previous: the crash-looping Pod has one; the steady one has none.
    let previous = wait_for(
        "a previous run of the crashing container",
        Duration::from_secs(30),
        || {
            Ok(c.kubectl(&["logs", "crashy", "-n", NS, "--previous"])
                .ok()
                .filter(|t| !t.is_empty()))
        },
    )?;
    ensure!(
        previous.contains("crashy main line 0"),
        "--previous gave {previous:?}"
    );
    let err = match c.kubectl(&["logs", "steady", "-n", NS, "--previous"]) {
        Ok(out) => bail!("--previous on a container that never restarted printed {out:?}"),
        Err(e) => e.to_string(),
    };
    ensure!(err.contains("previous terminated container"), "{err}");

    // What the apiserver lets through is checked by vkd too: 422 and 404, straight to the kubelet port.
    let (code, body) = kubelet_get(
        c,
        &format!("/containerLogs/{NS}/steady/main?sinceSeconds=0"),
    )?;
    ensure!(
        code == 422 && body.contains("sinceSeconds"),
        "{code} {body}"
    );
    let (code, _) = kubelet_get(c, &format!("/containerLogs/{NS}/steady/nope"))?;
    ensure!(code == 404, "unknown container gave {code}");
    let (code, _) = kubelet_get(c, &format!("/containerLogs/{NS}/ghost/main"))?;
    ensure!(code == 404, "unknown pod gave {code}");
    Ok(())
}

fn logs_follow(c: &Cluster) -> Result<()> {
    vkd(c)?;
    c.apply(&pod(
        "short",
        "{sim.vkd.io/behavior: exit, sim.vkd.io/run-for: 4s, sim.vkd.io/log-interval: 500ms}",
        "Never",
    ))?;
    wait_for("the short Pod to run", Duration::from_secs(30), || {
        let p = c.kubectl_json(&["get", "pod", "short", "-n", NS])?;
        Ok((at(&p, "status.phase") == "Running").then_some(()))
    })?;
    let started = Instant::now();
    let mut child = kubectl_cmd(c)?
        .args(["logs", "-f", "short", "-n", NS])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let out = child.stdout.take().context("no stdout")?;
    let mut arrivals = Vec::new();
    for line in BufReader::new(out).lines() {
        let line = line?;
        arrivals.push((started.elapsed(), line));
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "logs -f did not end with the container"
        );
    }
    let status = child.wait()?;
    ensure!(status.success(), "kubectl logs -f exited {status}");
    let n = arrivals.len();
    ensure!(
        (7..=9).contains(&n),
        "{n} lines for 4s at 500ms: {arrivals:?}"
    );
    let spread = arrivals[n - 1].0.saturating_sub(arrivals[0].0);
    ensure!(
        spread >= Duration::from_millis(1000),
        "lines arrived at once, not as produced: {arrivals:?}"
    );
    eprintln!(
        "logs -f: {n} lines over {:.1}s, ended {:.1}s after start",
        spread.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn kubectl_cmd(c: &Cluster) -> Result<Command> {
    let mut cmd = Command::new(c.env("VKD_E2E_KUBECTL")?);
    cmd.env("KUBECONFIG", c.kubeconfig());
    Ok(cmd)
}

fn exec(
    c: &Cluster,
    websocket: bool,
    stdin: Option<&str>,
    args: &[&str],
) -> Result<(i32, String, String)> {
    let mut cmd = kubectl_cmd(c)?;
    cmd.args(["exec", "-n", NS]);
    if stdin.is_some() {
        cmd.arg("-i");
    }
    cmd.args(["steady", "--"]).args(args);
    if !websocket {
        cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false");
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(input.as_bytes())?;
    } else {
        drop(child.stdin.take());
    }
    let out = child.wait_with_output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn exec_both_protocols(c: &Cluster) -> Result<()> {
    vkd(c)?;
    for websocket in [true, false] {
        let proto = if websocket { "websocket" } else { "spdy" };
        let (code, out, err) = exec(c, websocket, None, &["echo", "hello", "world"])?;
        ensure!(
            code == 0 && out == "hello world\n",
            "{proto} echo: {code} {out:?} {err:?}"
        );
        let (code, out, err) = exec(c, websocket, Some("hi\n"), &["cat"])?;
        ensure!(
            code == 0 && out == "hi\n",
            "{proto} cat: {code} {out:?} {err:?}"
        );
        let (code, _, err) = exec(c, websocket, None, &["exit", "3"])?;
        ensure!(code == 3, "{proto} exit 3 gave kubectl exit {code}: {err}");
        let (code, out, _) = exec(c, websocket, None, &["sh", "-c", "printenv"])?;
        ensure!(
            code == 0 && out.contains("GREETING=hello"),
            "{proto} env: {out:?}"
        );
        let (code, _, err) = exec(c, websocket, None, &["no-such-command"])?;
        ensure!(
            code == 127 && err.contains("command not found"),
            "{proto}: {code} {err:?}"
        );
        // A large output arrives whole (no flow-control stall).
        let (code, out, _) = exec(c, websocket, None, &["yes", "200000"])?;
        ensure!(
            code == 0 && out.len() == 400_000,
            "{proto} yes: {code} {} bytes",
            out.len()
        );
    }
    // The Node declares ExtendWebSocketsToKubelet, so WebSocket exec reached vkd
    // as WebSocket, not translated to SPDY by the apiserver.
    let metrics = c.kubectl(&["get", "--raw", "/metrics"])?;
    let proxied: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("apiserver_websocket_streaming_requests_total"))
        .filter(|l| l.contains("proxied_to_kubelet") && l.contains("exec"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    ensure!(
        proxied >= 6.0,
        "WebSocket exec requests proxied to the kubelet: {proxied}"
    );
    Ok(())
}

/// `kubectl exec -t` needs a terminal: util-linux `script` gives it one of a set size.
fn exec_tty(c: &Cluster) -> Result<()> {
    vkd(c)?;
    let kubectl = c.env("VKD_E2E_KUBECTL")?.to_owned();
    for (websocket, rows, cols) in [(true, 30, 100), (false, 31, 101)] {
        let env = if websocket {
            ""
        } else {
            "KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false "
        };
        let inner = format!(
            "stty rows {rows} cols {cols}; {env}{kubectl} exec -it -n {NS} steady -- stty size"
        );
        let out = Command::new("script")
            .args(["-qec", &inner, "/dev/null"])
            .env("KUBECONFIG", c.kubeconfig())
            .output()
            .context("running script(1)")?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success() && text.trim() == format!("{rows} {cols}"),
            "tty exec (websocket={websocket}) printed {text:?}"
        );
    }
    Ok(())
}

fn attach(c: &Cluster) -> Result<()> {
    vkd(c)?;
    for (name, websocket) in [("attachee-ws", true), ("attachee-spdy", false)] {
        c.apply(&pod(
            name,
            "{sim.vkd.io/behavior: exit, sim.vkd.io/run-for: 4s, sim.vkd.io/log-interval: 500ms}",
            "Never",
        ))?;
        wait_for(&format!("{name} to run"), Duration::from_secs(30), || {
            let p = c.kubectl_json(&["get", "pod", name, "-n", NS])?;
            Ok((at(&p, "status.phase") == "Running").then_some(()))
        })?;
        let started = Instant::now();
        let mut cmd = kubectl_cmd(c)?;
        cmd.args(["attach", name, "-n", NS]);
        if !websocket {
            cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false");
        }
        let out = cmd.output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            text.contains(&format!("{name} main line")),
            "attach {name} printed {text:?} / {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "attach {name} did not end with the container"
        );
    }
    Ok(())
}

fn port_forward(c: &Cluster) -> Result<()> {
    over_port_forward(c, |conn| {
        let payload = b"round trip through kubectl, the apiserver and vkd\n";
        let t = Instant::now();
        conn.write_all(payload)?;
        let mut back = vec![0u8; payload.len()];
        conn.read_exact(&mut back)?;
        ensure!(
            back == payload,
            "echo gave {:?}",
            String::from_utf8_lossy(&back)
        );
        eprintln!(
            "port-forward round trip {:.1} ms",
            t.elapsed().as_secs_f64() * 1000.0
        );
        Ok(())
    })
}

/// `kubectl port-forward` to port 8080 of pod/steady, and `talk` over a
/// connection to its listener (a 10 s read timeout); the port-forward ends
/// with it.
fn over_port_forward(
    c: &Cluster,
    talk: impl FnOnce(&mut std::net::TcpStream) -> Result<()>,
) -> Result<()> {
    vkd(c)?;
    let port = common::free_port()?;
    let mut child = kubectl_cmd(c)?
        .args([
            "port-forward",
            "-n",
            NS,
            "pod/steady",
            &format!("{port}:8080"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let result = (|| -> Result<()> {
        let mut conn = wait_for("the port-forward listener", Duration::from_secs(20), || {
            Ok(std::net::TcpStream::connect(("127.0.0.1", port)).ok())
        })?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        talk(&mut conn)
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// GET on vkd's kubelet port with the apiserver's kubelet client certificate.
fn kubelet_get(c: &Cluster, path: &str) -> Result<(u16, String)> {
    let port = vkd(c)?;
    let pki = c.dir().join("pki");
    curl(&[
        "--cert",
        &pki.join("apiserver-kubelet-client.crt")
            .display()
            .to_string(),
        "--key",
        &pki.join("apiserver-kubelet-client.key")
            .display()
            .to_string(),
        &format!("https://127.0.0.1:{port}{path}"),
    ])
}

fn curl(args: &[&str]) -> Result<(u16, String)> {
    let out = Command::new("curl")
        .args(["-sk", "-w", "\n%{http_code}"])
        .args(args)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').context("no status from curl")?;
    Ok((code.trim().parse().unwrap_or(0), body.to_owned()))
}

fn stats_with_cert(c: &Cluster) -> Result<()> {
    vkd(c)?;
    let (code, body) = kubelet_get(c, "/stats/summary")?;
    ensure!(code == 200, "stats/summary: {code} {body}");
    let v: Value = serde_json::from_str(&body)?;
    ensure!(str_at(&v, "node.nodeName") == NODE, "{body}");
    ensure!(
        at(&v, "node.cpu.usageNanoCores").as_u64().unwrap_or(0) > 0,
        "zero node cpu: {body}"
    );
    ensure!(
        at(&v, "node.memory.workingSetBytes").as_u64().unwrap_or(0) > 0,
        "zero node memory"
    );
    let pods = at(&v, "pods").as_array().cloned().unwrap_or_default();
    let steady = pods
        .iter()
        .find(|p| str_at(p, "podRef.name") == "steady")
        .context("steady not in summary")?;
    ensure!(
        at(steady, "containers.0.cpu.usageCoreNanoSeconds")
            .as_u64()
            .unwrap_or(0)
            > 0,
        "{steady}"
    );

    let (code, metrics) = kubelet_get(c, "/metrics/resource")?;
    ensure!(code == 200, "metrics/resource {code}");
    let line = metrics
        .lines()
        .find(|l| l.starts_with("container_memory_working_set_bytes{container=\"main\",namespace=\"kapi\",pod=\"steady\"}"))
        .context("no container memory metric")?;
    let value: f64 = line.split(' ').nth(1).unwrap_or("0").parse()?;
    ensure!(value > 0.0, "{line}");

    let (code, body) = kubelet_get(c, "/pods")?;
    let list: Value = serde_json::from_str(&body)?;
    ensure!(
        code == 200 && at(&list, "items").as_array().is_some_and(|i| !i.is_empty()),
        "/pods {code}"
    );
    let (code, body) = kubelet_get(c, "/runningpods")?;
    ensure!(
        code == 200 && body.contains("steady"),
        "/runningpods {code} {body}"
    );
    let (code, body) = kubelet_get(c, "/healthz")?;
    ensure!(code == 200 && body == "ok", "/healthz {code} {body}");
    Ok(())
}

fn auth_refusals(c: &Cluster) -> Result<()> {
    let port = vkd(c)?;
    let url = format!("https://127.0.0.1:{port}/stats/summary");
    let (code, body) = curl(&[&url])?;
    ensure!(code == 401, "no credentials gave {code}");
    let status: Value = serde_json::from_str(&body)?;
    ensure!(
        status["kind"] == "Status" && status["reason"] == "Unauthorized",
        "{body}"
    );

    c.kubectl(&["create", "serviceaccount", "no-node-access", "-n", NS])?;
    let token = c.kubectl(&["create", "token", "no-node-access", "-n", NS])?;
    let header = format!("Authorization: Bearer {}", token.trim());
    let (code, body) = curl(&[
        "-H",
        &header,
        &format!("https://127.0.0.1:{port}/containerLogs/{NS}/steady/main"),
    ])?;
    ensure!(
        code == 403,
        "a token without nodes/proxy gave {code}: {body}"
    );
    let status: Value = serde_json::from_str(&body)?;
    ensure!(
        status["reason"] == "Forbidden" && body.contains("nodes/proxy"),
        "{body}"
    );
    let (code, _) = curl(&["-H", "Authorization: Bearer not-a-token", &url])?;
    ensure!(code == 401, "a bad token gave {code}");
    // The same ServiceAccount, once allowed, gets through.
    c.kubectl(&[
        "create",
        "clusterrole",
        "kapi-node-stats",
        "--verb=get",
        "--resource=nodes/stats",
    ])?;
    c.kubectl(&[
        "create",
        "clusterrolebinding",
        "kapi-node-stats",
        "--clusterrole=kapi-node-stats",
        &format!("--serviceaccount={NS}:no-node-access"),
    ])?;
    wait_for(
        "the bound ServiceAccount to read stats",
        Duration::from_secs(60),
        || {
            let (code, _) = curl(&["-H", &header, &url])?;
            if code == 403 {
                return Ok(None);
            }
            if code != 200 {
                bail!("stats with a bound token gave {code}");
            }
            Ok(Some(()))
        },
    )?;
    Ok(())
}

/// The upstream spec "[sig-cli] Kubectl Port forwarding ... should support a
/// client that connects, sends DATA, and disconnects": the client sends,
/// closes its write side and reads to EOF. The sim's echo server then closes
/// its side too, and kubectl must see that (data and error streams ended) to
/// close the client's connection.
fn port_forward_pod_side_close(c: &Cluster) -> Result<()> {
    over_port_forward(c, |conn| {
        conn.write_all(b"abc")?;
        conn.shutdown(std::net::Shutdown::Write)?;
        let t = Instant::now();
        let mut back = Vec::new();
        conn.read_to_end(&mut back).with_context(|| {
            format!(
                "no EOF after {:?}: the Pod side's close was not passed on",
                t.elapsed()
            )
        })?;
        ensure!(back == b"abc", "got {:?}", String::from_utf8_lossy(&back));
        Ok(())
    })
}

type Wss =
    tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

/// A WebSocket to the apiserver (as admin, HTTP/1.1) on `path`, offering
/// `protocols`; with the subprotocol the far end chose.
async fn apiserver_websocket(
    c: &Cluster,
    path: &str,
    protocols: &str,
) -> Result<(Wss, Option<String>)> {
    use rustls_pki_types::pem::PemObject;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let addr = common::apiserver_addr(c)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(c.env("VKD_E2E_CA")?)? {
        roots.add(cert?)?;
    }
    let certs = rustls_pki_types::CertificateDer::pem_file_iter(c.env("VKD_E2E_ADMIN_CERT")?)?
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let key = rustls_pki_types::PrivateKeyDer::from_pem_file(c.env("VKD_E2E_ADMIN_KEY")?)?;
    let mut config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_client_auth_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::from(addr.ip());
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await?;
    let mut req = format!("wss://{addr}{path}").into_client_request()?;
    req.headers_mut()
        .insert("sec-websocket-protocol", protocols.parse()?);
    let (ws, resp) = tokio_tungstenite::client_async(req, tls)
        .await
        .with_context(|| format!("WebSocket to {path} offering {protocols}"))?;
    let chosen = resp
        .headers()
        .get("sec-websocket-protocol")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    Ok((ws, chosen))
}

/// The payloads of the messages until the far end closes, as bytes.
async fn read_all(ws: &mut Wss) -> Result<Vec<Vec<u8>>> {
    use futures::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let mut got = Vec::new();
    let read = async {
        while let Some(m) = ws.next().await {
            match m? {
                Message::Binary(b) => got.push(b.to_vec()),
                Message::Text(t) => got.push(t.as_bytes().to_vec()),
                Message::Close(_) => break,
                _ => {}
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .context("the WebSocket did not close")??;
    Ok(got)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn base64(text: &[u8]) -> Result<Vec<u8>> {
    // Test-side decoding by the system's base64(1), independent of vkd's.
    let mut child = Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(text)?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "base64 -d {:?}",
        String::from_utf8_lossy(text)
    );
    Ok(out.stdout)
}

/// Clients other than a recent kubectl (the official Python client, web
/// consoles) speak the older channel protocols, which the apiserver passes to
/// the kubelet unchanged.
fn exec_older_websocket_protocols(c: &Cluster) -> Result<()> {
    vkd(c)?;
    let rt = runtime()?;
    let base = format!("/api/v1/namespaces/{NS}/pods/steady/exec?stdout=true&stderr=true");
    for (protocol, b64, v4) in [
        ("base64.channel.k8s.io", true, false),
        ("channel.k8s.io", false, false),
        ("v4.channel.k8s.io", false, true),
        ("v4.base64.channel.k8s.io", true, true),
    ] {
        for (command, code) in [
            ("command=echo&command=hello", 0),
            ("command=exit&command=3", 3),
        ] {
            let path = format!("{base}&{command}");
            let messages = rt.block_on(async {
                let (mut ws, chosen) = apiserver_websocket(c, &path, protocol).await?;
                ensure!(
                    chosen.as_deref() == Some(protocol),
                    "chose {chosen:?} for {protocol}"
                );
                read_all(&mut ws).await
            })?;
            let mut channels: [Vec<u8>; 4] = Default::default();
            for m in &messages {
                let (&first, rest) = m.split_first().context("an empty message")?;
                let channel = if b64 { first.wrapping_sub(b'0') } else { first };
                let payload = if b64 { base64(rest)? } else { rest.to_vec() };
                ensure!(channel < 4, "{protocol}: message on channel {channel}");
                channels[usize::from(channel)].extend(payload);
            }
            let error = String::from_utf8_lossy(&channels[3]).into_owned();
            if code == 0 {
                ensure!(
                    channels[1] == b"hello\n",
                    "{protocol}: stdout {:?}",
                    channels[1]
                );
                if v4 {
                    let status: Value = serde_json::from_str(&error)?;
                    ensure!(status["status"] == "Success", "{protocol}: {error}");
                } else {
                    ensure!(error.is_empty(), "{protocol}: success wrote {error:?}");
                }
            } else if v4 {
                let status: Value = serde_json::from_str(&error)?;
                ensure!(
                    status["reason"] == "NonZeroExitCode"
                        && status["details"]["causes"][0]["message"] == "3",
                    "{protocol}: {error}"
                );
            } else {
                ensure!(error.contains("exit code 3"), "{protocol}: {error:?}");
            }
        }
    }
    Ok(())
}

/// The kubelet's own WebSocket port-forward (the Python client's): a data and
/// an error channel per port, each opened with the port number.
fn port_forward_websocket_channels(c: &Cluster) -> Result<()> {
    use futures::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    vkd(c)?;
    let rt = runtime()?;
    let path = format!("/api/v1/namespaces/{NS}/pods/steady/portforward?ports=8080");
    for (protocol, b64) in [
        ("v4.channel.k8s.io", false),
        ("v4.base64.channel.k8s.io", true),
    ] {
        let messages = rt.block_on(async {
            let (mut ws, chosen) = apiserver_websocket(c, &path, protocol).await?;
            ensure!(
                chosen.as_deref() == Some(protocol),
                "chose {chosen:?} for {protocol}"
            );
            let hello = if b64 {
                Message::Text("0aGVsbG8=".into()) // "hello"
            } else {
                Message::Binary(bytes::Bytes::from_static(b"\x00hello"))
            };
            ws.send(hello).await?;
            let mut got = Vec::new();
            let read = async {
                use futures::StreamExt;
                while got.len() < 3 {
                    match ws.next().await.context("closed early")?? {
                        Message::Binary(b) => got.push(b.to_vec()),
                        Message::Text(t) => got.push(t.as_bytes().to_vec()),
                        _ => {}
                    }
                }
                anyhow::Ok(())
            };
            tokio::time::timeout(Duration::from_secs(10), read)
                .await
                .with_context(|| format!("{protocol}: got only {got:?}"))??;
            ws.close(None).await.ok();
            anyhow::Ok(got)
        })?;
        let decoded: Vec<(u8, Vec<u8>)> = messages
            .iter()
            .map(|m| {
                let (&first, rest) = m.split_first().context("an empty message")?;
                Ok(if b64 {
                    (first.wrapping_sub(b'0'), base64(rest)?)
                } else {
                    (first, rest.to_vec())
                })
            })
            .collect::<Result<_>>()?;
        let port = 8080u16.to_le_bytes().to_vec();
        ensure!(
            decoded == [(0, port.clone()), (1, port), (0, b"hello".to_vec())],
            "{protocol}: {decoded:?}"
        );
    }
    Ok(())
}

/// The apiserver reaches vkd over HTTP/2 (as it does a kubelet) and serves
/// `kubectl logs` over WebSocket from that body: it used to come back empty.
fn logs_http2_and_websocket(c: &Cluster) -> Result<()> {
    let port = vkd(c)?;
    let rt = runtime()?;
    let path = format!("/api/v1/namespaces/{NS}/pods/steady/log?container=main");
    let messages = rt.block_on(async {
        let (mut ws, _) = apiserver_websocket(c, &path, "binary.k8s.io").await?;
        read_all(&mut ws).await
    })?;
    let text = String::from_utf8_lossy(&messages.concat()).into_owned();
    ensure!(
        text.starts_with(&format!("sim: {NS}/steady main line 0\n")),
        "logs over WebSocket: {text:?}"
    );

    let pki = c.dir().join("pki");
    let out = Command::new("curl")
        .args(["-sk", "--http2", "-o", "/dev/null", "-w", "%{http_version}"])
        .arg("--cert")
        .arg(pki.join("apiserver-kubelet-client.crt"))
        .arg("--key")
        .arg(pki.join("apiserver-kubelet-client.key"))
        .arg(format!(
            "https://127.0.0.1:{port}/containerLogs/{NS}/steady/main"
        ))
        .output()?;
    let version = String::from_utf8_lossy(&out.stdout);
    ensure!(version == "2", "logs over HTTP version {version:?}");
    Ok(())
}
