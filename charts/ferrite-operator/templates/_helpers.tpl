{{/* Names and labels, following `helm create`'s conventions. */}}

{{- define "ferrite-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ferrite-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ferrite-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ferrite-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferrite-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ferrite-operator.labels" -}}
helm.sh/chart: {{ include "ferrite-operator.chart" . }}
{{ include "ferrite-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferrite
{{- end }}

{{- define "ferrite-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ferrite-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ferrite-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
ferrite-router's name: `ferrite-router` whatever the release is called (the README's
`kubectl port-forward svc/ferrite-router` relies on it), or router.fullnameOverride.
*/}}
{{- define "ferrite-operator.router.fullname" -}}
{{- default "ferrite-router" .Values.router.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- /* The Secret holding the router's serving certificate. */}}
{{- define "ferrite-operator.router.tlsSecret" -}}
{{- default (printf "%s-tls" (include "ferrite-operator.router.fullname" .)) .Values.router.tls.secretName }}
{{- end }}

{{- define "ferrite-operator.router.selectorLabels" -}}
app.kubernetes.io/name: ferrite-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- /* The router pods' label selector as one flag value (k=v,k=v). */}}
{{- define "ferrite-operator.router.selector" -}}
{{- $pairs := list }}
{{- range $k, $v := include "ferrite-operator.router.selectorLabels" . | fromYaml }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{- /* The labels of the router's metrics Service (with tenants), which its ServiceMonitor selects. */}}
{{- define "ferrite-operator.router.metricsServiceLabels" -}}
app.kubernetes.io/name: ferrite-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router-metrics
{{- end }}

{{- define "ferrite-operator.router.labels" -}}
helm.sh/chart: {{ include "ferrite-operator.chart" . }}
{{ include "ferrite-operator.router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferrite
{{- end }}

{{- define "ferrite-operator.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "ferrite-operator.router.fullname" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ferrite-operator.router.image" -}}
{{- $image := .Values.router.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* The Service of the External Metrics API (the APIService points here). */}}
{{- define "ferrite-operator.externalMetricsService" -}}
{{- printf "%s-external-metrics" (include "ferrite-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ferrite-operator.tlsSecret" -}}
{{- printf "%s-external-metrics-tls" (include "ferrite-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ferrite-operator.dashboardsNamespace" -}}
{{- default .Release.Namespace .Values.monitoring.dashboards.namespace }}
{{- end }}

{{/*
Whether a monitoring object is wanted: `true`, `false`, or `auto` (only where the cluster serves
the Prometheus Operator's API for it). Call with (list $enabled "monitoring.coreos.com/v1/Kind" $).
*/}}
{{- define "ferrite-operator.monitoringWanted" -}}
{{- $enabled := index . 0 }}
{{- $api := index . 1 }}
{{- $root := index . 2 }}
{{- if eq (toString $enabled) "auto" }}
{{- if $root.Capabilities.APIVersions.Has $api }}true{{ end }}
{{- else if $enabled }}true{{ end }}
{{- end }}

{{/* Checks that combinations of values make sense; fails the render with a message if not. */}}
{{- define "ferrite-operator.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail "replicaCount > 1 needs leaderElection.enabled: true (replicas without a Lease would all reconcile and autoscale)" }}
{{- end }}
{{- if and .Values.keda.enabled .Values.externalMetrics.enabled }}
{{- fail "keda.enabled and externalMetrics.enabled exclude each other: KEDA serves the cluster's External Metrics API (v1beta1.external.metrics.k8s.io), so the operator's cannot be registered beside it; with KEDA, use autoscaling.mode KEDA instead of HPA" }}
{{- end }}
{{- if and .Values.externalMetrics.certManager.enabled (not .Values.externalMetrics.enabled) }}
{{- fail "externalMetrics.certManager.enabled needs externalMetrics.enabled: true" }}
{{- end }}
{{- if and .Values.keda.enabled .Values.keda.externalScaler.enabled (eq (int .Values.keda.externalScaler.port) (int .Values.service.port)) }}
{{- fail "keda.externalScaler.port must differ from service.port" }}
{{- end }}
{{- if and .Values.externalMetrics.enabled (eq (int .Values.externalMetrics.port) (int .Values.service.port)) }}
{{- fail "externalMetrics.port must differ from service.port" }}
{{- end }}
{{- $router := .Values.router }}
{{- if and $router.enabled (lt (int $router.terminationGracePeriodSeconds) (add (int $router.drainDelaySeconds) 10)) }}
{{- fail "router.terminationGracePeriodSeconds must be at least router.drainDelaySeconds + 10 (after the drain delay, open streams need time to finish)" }}
{{- end }}
{{- if and $router.enabled (eq (include "ferrite-operator.router.fullname" .) (include "ferrite-operator.fullname" .)) }}
{{- fail "router.fullnameOverride must differ from the operator's name" }}
{{- end }}
{{- if and $router.tls.certManager.enabled (not $router.tls.enabled) }}
{{- fail "router.tls.certManager.enabled needs router.tls.enabled: true" }}
{{- end }}
{{- if and $router.tls.enabled (not $router.tls.secretName) (not $router.tls.certManager.enabled) }}
{{- fail "router.tls.enabled needs router.tls.secretName (a kubernetes.io/tls Secret) or router.tls.certManager.enabled: true" }}
{{- end }}
{{- end }}

{{/*
Labels of a ServiceMonitor or PrometheusRule: `release: <monitoring.release>` for
kube-prometheus-stack's selectors, then the object's own extra labels (which win).
Call with (list LABELS $).
*/}}
{{- define "ferrite-operator.monitoringLabels" -}}
{{- $labels := index . 0 | default dict }}
{{- $root := index . 1 }}
{{- $all := dict }}
{{- with $root.Values.monitoring.release }}
{{- $_ := set $all "release" . }}
{{- end }}
{{- $all = merge (deepCopy $labels) $all }}
{{- if $all }}
{{- toYaml $all }}
{{- end }}
{{- end }}

{{- /*
The peers admitted to every model pod: the operator's pods, the router's (when installed), and
networkPolicy.prometheus and extraPeers, as a YAML list of NetworkPolicyPeers.
*/}}
{{- define "ferrite-operator.networkPolicyPeers" -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .Release.Namespace }}
  podSelector:
    matchLabels:
      {{- include "ferrite-operator.selectorLabels" . | nindent 6 }}
{{- if .Values.router.enabled }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .Release.Namespace }}
  podSelector:
    matchLabels:
      {{- include "ferrite-operator.router.selectorLabels" . | nindent 6 }}
{{- end }}
{{- with .Values.networkPolicy.prometheus }}
{{ toYaml . }}
{{- end }}
{{- with .Values.networkPolicy.extraPeers }}
{{ toYaml . }}
{{- end }}
{{- end }}
