{{/* Names, labels and images shared by every template. */}}

{{- define "corral.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>", or just the release name when it already contains the chart name. */}}
{{- define "corral.fullname" -}}
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

{{- /* The base is cut to leave room for the suffix: cut after it, a long fullnameOverride gave the
operator's and the gateway's objects one name. */ -}}
{{- define "corral.operator.fullname" -}}
{{- printf "%s-operator" (include "corral.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{- define "corral.gateway.fullname" -}}
{{- printf "%s-gateway" (include "corral.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "corral.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "corral.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "corral.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create }}
{{- default (include "corral.gateway.fullname" .) .Values.gateway.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "corral.peeringName" -}}
{{- default (include "corral.fullname" .) .Values.operator.peering.name }}
{{- end }}

{{/* Selector labels of a component: (dict "ctx" $ "component" "gateway"). Never change them: Deployment
selectors are immutable. */}}
{{- define "corral.selectorLabels" -}}
app.kubernetes.io/name: {{ include "corral.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "corral.labels" -}}
{{ include "corral.selectorLabels" . }}
app.kubernetes.io/part-of: corral
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Image reference: (dict "ctx" $ "image" .Values.gateway.image). */}}
{{- define "corral.image" -}}
{{- $tag := .image.tag | default .ctx.Values.image.tag | default .ctx.Chart.AppVersion }}
{{- printf "%s/%s:%s" .ctx.Values.image.registry .image.repository $tag }}
{{- end }}

{{/* Engine pods are labelled by the operator (corral_operator/labels.py), not by this chart. */}}
{{- define "corral.engineSelector" -}}
app.kubernetes.io/managed-by: corral-operator
app.kubernetes.io/component: engine
{{- end }}

{{/* Should ServiceMonitor/PodMonitor objects be rendered? */}}
{{- define "corral.monitoringEnabled" -}}
{{- include "corral.monitorKind" (list . "ServiceMonitor") }}
{{- end }}

{{/* Whether to render a monitoring.coreos.com/v1 kind: (list $ "PodMonitor"). Each kind is asked for
by itself: a cluster may serve ServiceMonitor and not PodMonitor or PrometheusRule (CRDs installed
one by one), and an object of a kind it does not serve fails the whole install. */}}
{{- define "corral.monitorKind" -}}
{{- $ctx := index . 0 }}
{{- if eq $ctx.Values.monitoring.create "always" }}true
{{- else if and (eq $ctx.Values.monitoring.create "auto") ($ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" (index . 1))) }}true
{{- end }}
{{- end }}

{{/* A component's pod labels: (dict "ctx" $ "component" "gateway" "extra" .Values.gateway.podLabels).
The chart's labels win over podLabels: a selector label overridden there would no longer match the
Deployment's (immutable) selector, and the API server would refuse the Deployment. */}}
{{- define "corral.podLabels" -}}
{{- $own := include "corral.labels" . | fromYaml }}
{{- toYaml (merge $own (deepCopy (.extra | default dict))) }}
{{- end }}

{{/* Scheduling of a component's pods: (dict "ctx" $ "component" "gateway" "values" .Values.gateway).
A spread constraint without a labelSelector counts the component's own pods (without one it counts
none, and spreads nothing). */}}
{{- define "corral.placement" -}}
{{- $selector := include "corral.selectorLabels" . | fromYaml }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  {{- $constraint := deepCopy . }}
  {{- if not $constraint.labelSelector }}
  {{- $_ := set $constraint "labelSelector" (dict "matchLabels" $selector) }}
  {{- end }}
  - {{- toYaml $constraint | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
