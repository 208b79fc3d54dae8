//! Logs to stderr through tracing, and with the `otel` cargo feature, spans to an
//! OpenTelemetry collector over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is
//! set (the standard OTEL_* variables configure the rest). Reconciles carry the
//! Pod's UID and name as span fields, so a trace ties the Pod to its instance.

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::LogFormat;

/// Keeps the exporter alive; flushes spans when dropped.
#[derive(Debug, Default)]
pub struct Telemetry {
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        #[cfg(feature = "otel")]
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

type BoxedLayer = Box<dyn Layer<Registry> + Send + Sync>;

pub fn init(format: LogFormat) -> Telemetry {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,kube=warn,hyper=warn"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let fmt: BoxedLayer = match format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    #[allow(unused_mut)]
    let mut layers: Vec<BoxedLayer> = vec![fmt.with_filter(filter).boxed()];
    #[allow(unused_mut)]
    let mut telemetry = Telemetry::default();
    #[cfg(feature = "otel")]
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
        match otel() {
            Ok((layer, provider)) => {
                layers.push(layer);
                telemetry.provider = Some(provider);
            }
            Err(e) => eprintln!("vkd: OpenTelemetry export is off: {e}"),
        }
    }
    tracing_subscriber::registry().with(layers).init();
    telemetry
}

#[cfg(feature = "otel")]
fn otel() -> Result<(BoxedLayer, opentelemetry_sdk::trace::SdkTracerProvider), String> {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|e| e.to_string())?;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("vkd")
                .build(),
        )
        .build();
    let tracer = provider.tracer("vkd");
    let filter = EnvFilter::new("info,kube=warn,hyper=warn");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(filter)
        .boxed();
    Ok((layer, provider))
}
