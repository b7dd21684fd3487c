{{/* The app name in labels; nameOverride changes it (and the selector: reinstall then). */}}
{{- define "tardigrade.name" -}}
{{- default "tardigrade-operator" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tardigrade.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tardigrade.labels" -}}
app.kubernetes.io/name: {{ include "tardigrade.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tardigrade.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tardigrade.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Keep the operator off capacity that can be reclaimed at 30 s notice: a node without the
label matches NotIn. Labels from GKE's "Spot VMs" and "Preemptible VMs" pages. */}}
{{- define "tardigrade.offSpotNodeAffinity" -}}
requiredDuringSchedulingIgnoredDuringExecution:
  nodeSelectorTerms:
    - matchExpressions:
        - {key: cloud.google.com/gke-spot, operator: NotIn, values: ["true"]}
        - {key: cloud.google.com/gke-preemptible, operator: NotIn, values: ["true"]}
{{- end -}}

{{- define "tardigrade.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tardigrade.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}
