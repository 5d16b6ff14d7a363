"""Export: catalog (the metric table), prometheus (scrape-time collector), server (HTTP), otlp."""
